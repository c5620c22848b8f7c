package netem

import (
	"fmt"
	"net"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/infernode/infernode/internal/testenv"
)

// tcpReach reports whether host h gets an answer (accepted or refused) to a TCP
// connection attempt to ip, port 9.
func tcpReach(t *testing.T, h *Host, ip string) bool {
	out, _ := exec.Command("ip", "netns", "exec", h.NS, "timeout", "2", "bash", "-c",
		"exec 3<>/dev/tcp/"+ip+"/9 && echo open").CombinedOutput()
	return strings.Contains(string(out), "open") || strings.Contains(string(out), "refused")
}

func TestTopologyAndFaults(t *testing.T) {
	if err := Available(); err != nil {
		testenv.Require(t, false, fmt.Sprintf("network namespaces unavailable (they need root): %v", err))
	}
	topo, err := New("inft", 3)
	if err != nil {
		t.Fatal(err)
	}
	defer topo.Close()
	a, b, c := topo.Nodes[0], topo.Nodes[1], topo.Nodes[2]
	if !tcpReach(t, a, b.IP) || !tcpReach(t, b, c.IP) {
		t.Fatal("hosts cannot reach each other")
	}
	// The driver on the bridge reaches a host.
	if conn, err := net.DialTimeout("tcp", a.IP+":9", time.Second); err == nil {
		conn.Close()
	} else if !strings.Contains(err.Error(), "refused") {
		t.Fatalf("driver cannot reach %s: %v", a.IP, err)
	}

	if err := a.Isolate(); err != nil {
		t.Fatal(err)
	}
	if tcpReach(t, a, b.IP) || tcpReach(t, c, a.IP) {
		t.Error("isolated host still talks to the others")
	}
	if !tcpReach(t, b, c.IP) {
		t.Error("isolating a cut b from c")
	}
	if err := a.Heal(); err != nil {
		t.Fatal(err)
	}
	if !tcpReach(t, a, b.IP) || !tcpReach(t, c, a.IP) {
		t.Error("heal did not restore a")
	}

	// One-way: a cannot send to b, b still reaches... nothing that needs an answer from a;
	// a TCP handshake needs both ways, so check the drop counter instead.
	if err := a.DropTo(b); err != nil {
		t.Fatal(err)
	}
	if tcpReach(t, a, b.IP) {
		t.Error("one-way drop let a reach b")
	}
	if !tcpReach(t, a, c.IP) {
		t.Error("one-way drop to b cut a from c")
	}
	a.Heal()

	if err := a.Loss(100); err != nil {
		t.Fatal(err)
	}
	if tcpReach(t, a, b.IP) {
		t.Error("100% loss let a reach b")
	}
	a.Heal()
	if err := a.Bandwidth(512); err != nil {
		t.Fatal(err)
	}
	if err := a.Delay(50, 10); err != nil && !strings.Contains(err.Error(), "sch_netem") {
		t.Errorf("Delay: %v", err)
	}
	if err := topo.HealAll(); err != nil {
		t.Fatal(err)
	}
	if !tcpReach(t, a, b.IP) {
		out, _ := exec.Command("ip", "netns", "exec", a.NS, "nft", "list", "ruleset").CombinedOutput()
		q, _ := exec.Command("ip", "netns", "exec", a.NS, "tc", "qdisc", "show").CombinedOutput()
		t.Errorf("HealAll did not restore a:\n%s\n%s", out, q)
	}
}

func TestCleanupRemovesLeftovers(t *testing.T) {
	if err := Available(); err != nil {
		testenv.Require(t, false, fmt.Sprintf("network namespaces unavailable (they need root): %v", err))
	}
	topo, err := New("infc", 2)
	if err != nil {
		t.Fatal(err)
	}
	_ = topo // a run that dies here leaves everything behind
	Cleanup("infc")
	Cleanup("infc")
	out, _ := exec.Command("ip", "netns", "list").Output()
	links, _ := exec.Command("ip", "-o", "link", "show").Output()
	if strings.Contains(string(out), "infc-") || strings.Contains(string(links), "infcbr0") {
		t.Errorf("leftovers after Cleanup:\n%s\n%s", out, links)
	}
}

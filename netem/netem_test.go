package netem

import (
	"errors"
	"fmt"
	"io"
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

	// 30% loss: of 1,000 datagrams from a to b, the loss rule drops about 300.
	if err := a.Loss(30); err != nil {
		t.Fatal(err)
	}
	send := exec.Command("ip", "netns", "exec", a.NS, "bash", "-c",
		// A dropped datagram fails its write (EPERM from the output chain): ignore those.
		"for i in $(seq 1000); do echo x > /dev/udp/"+b.IP+"/9; done 2>/dev/null; true")
	if out, err := send.CombinedOutput(); err != nil {
		t.Fatalf("send datagrams: %v %s", err, out)
	}
	if n, err := a.Dropped(); err != nil || n < 240 || n > 360 {
		t.Errorf("30%% loss dropped %d of 1000 datagrams (%v), want 240-360", n, err)
	}
	a.Heal()

	// A 256 kbit/s cap: 64 KiB from a take about 2s instead of milliseconds.
	fast := sendTime(t, a, 64<<10)
	if err := a.Bandwidth(256); err != nil {
		t.Fatal(err)
	}
	slow := sendTime(t, a, 64<<10)
	t.Logf("64 KiB from a: %v uncapped, %v at 256 kbit/s", fast, slow)
	if slow < 1500*time.Millisecond || slow < 5*fast {
		t.Errorf("256 kbit/s cap: 64 KiB took %v (uncapped %v), want about 2s", slow, fast)
	}
	a.Heal()

	// Delay, where the kernel has sch_netem: a's answers come 50ms later.
	base := refusalTime(t, a)
	switch err := a.Delay(50, 0); {
	case errors.Is(err, ErrUnsupported):
		t.Logf("delay not measured: %v", err)
	case err != nil:
		t.Errorf("Delay: %v", err)
	default:
		if d := refusalTime(t, a); d-base < 45*time.Millisecond {
			t.Errorf("50ms delay: a connection refusal took %v (base %v)", d, base)
		}
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

// sendTime is how long host h takes to send n bytes over TCP to a listener of the driver.
func sendTime(t *testing.T, h *Host, n int) time.Duration {
	t.Helper()
	ln, err := net.Listen("tcp", DriverIP+":0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	got := make(chan time.Duration, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			got <- 0
			return
		}
		defer c.Close()
		start := time.Now()
		io.Copy(io.Discard, c)
		got <- time.Since(start)
	}()
	port := ln.Addr().(*net.TCPAddr).Port
	cmd := exec.Command("ip", "netns", "exec", h.NS, "bash", "-c",
		fmt.Sprintf("head -c %d /dev/zero > /dev/tcp/%s/%d", n, DriverIP, port))
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("send from %s: %v %s", h.NS, err, out)
	}
	return <-got
}

// refusalTime is how long a connection from the driver to a closed port of h takes to be
// refused: one round trip.
func refusalTime(t *testing.T, h *Host) time.Duration {
	t.Helper()
	start := time.Now()
	if c, err := net.DialTimeout("tcp", h.IP+":9", 2*time.Second); err == nil {
		c.Close()
	}
	return time.Since(start)
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

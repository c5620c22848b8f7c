package netem

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

// testRange is where topologies take their subnets: one /24 each, 10.77.X.0/24.
const testRange = "10.77."

// inTestRange finds the X of every 10.77.X.Y in ip's listings.
var inTestRange = regexp.MustCompile(`(?m)(?:^|[^0-9.])10\.77\.(\d+)\.`)

// ErrUnsupported means this kernel or machine cannot apply a fault.
var ErrUnsupported = errors.New("netem: not supported on this machine")

// Available reports whether namespaces can be built here, and if not, why.
func Available() error {
	if os.Geteuid() != 0 {
		return fmt.Errorf("%w: network namespaces need root", ErrUnsupported)
	}
	for _, tool := range []string{"ip", "tc", "nft"} {
		if _, err := exec.LookPath(tool); err != nil {
			return fmt.Errorf("%w: %s not installed", ErrUnsupported, tool)
		}
	}
	name := "infprobe" + fmt.Sprint(os.Getpid()%100000)
	if err := run("ip", "netns", "add", name); err != nil {
		return fmt.Errorf("%w: cannot create a network namespace: %v", ErrUnsupported, err)
	}
	run("ip", "netns", "del", name)
	return nil
}

// Topology is a bridge and one namespace per node, on a /24 of its own.
type Topology struct {
	prefix string
	bridge string
	Nodes  []*Host

	// Subnet is the topology's range: it exists only on its bridge and in its namespaces.
	// DriverIP is the bridge's own address, where the test driver reaches the hosts from.
	Subnet   string
	DriverIP string

	mu     sync.Mutex
	closed bool
}

// Host is one node's namespace.
type Host struct {
	Index int
	NS    string // namespace name
	IP    string // address on the test network
	veth  string // the host-side end of its veth pair (on the bridge)
	t     *Topology

	mu       sync.Mutex
	delayers []*delayer // userspace delays (see Delay)
}

// New builds a topology of n hosts. prefix names everything it creates (at most 6
// characters; "inf" if empty). Leftovers of an earlier run with the same prefix are
// removed first.
func New(prefix string, n int) (*Topology, error) {
	if prefix == "" {
		prefix = "inf"
	}
	if len(prefix) > 6 || n < 1 || n > 200 {
		return nil, fmt.Errorf("netem: prefix %q (at most 6 characters) and 1..200 hosts, got %d", prefix, n)
	}
	if err := Available(); err != nil {
		return nil, err
	}
	Cleanup(prefix)
	t := &Topology{prefix: prefix, bridge: prefix + "br0"}
	if err := run("ip", "link", "add", t.bridge, "type", "bridge"); err != nil {
		return nil, err
	}
	pre, err := t.claimSubnet()
	if err == nil {
		err = run("ip", "link", "set", t.bridge, "up")
	}
	if err != nil {
		t.Close()
		return nil, err
	}
	for i := range n {
		h := &Host{Index: i, NS: fmt.Sprintf("%s-n%d", prefix, i+1), IP: fmt.Sprintf("%s%d", pre, 10+i+1),
			veth: fmt.Sprintf("%sv%d", prefix, i+1), t: t}
		steps := [][]string{
			{"ip", "netns", "add", h.NS},
			{"ip", "link", "add", h.veth, "type", "veth", "peer", "name", "eth0", "netns", h.NS},
			{"ip", "link", "set", h.veth, "master", t.bridge},
			{"ip", "link", "set", h.veth, "up"},
			{"ip", "-n", h.NS, "addr", "add", h.IP + "/24", "dev", "eth0"},
			{"ip", "-n", h.NS, "link", "set", "eth0", "up"},
			{"ip", "-n", h.NS, "link", "set", "lo", "up"},
			{"ip", "netns", "exec", h.NS, "nft", "add table inet netem"},
			{"ip", "netns", "exec", h.NS, "nft", "add chain inet netem in { type filter hook input priority 0; }"},
			{"ip", "netns", "exec", h.NS, "nft", "add chain inet netem out { type filter hook output priority 0; }"},
		}
		for _, s := range steps {
			if err := run(s...); err != nil {
				t.Close()
				return nil, err
			}
		}
		t.Nodes = append(t.Nodes, h)
	}
	return t, nil
}

// claimSubnet gives the bridge the first 10.77.X.0/24 that no address or route on this
// machine is in, and returns its "10.77.X." prefix. Two bridges on one subnet break the
// driver: its answers to one topology's hosts leave by the other's bridge, and their
// connections to it time out (TestTopologiesSideBySide; a CI run's netem tests failed
// so, most likely beside a killed run's leftover bridge). A lock file keeps two
// processes building topologies at once from taking the same subnet.
func (t *Topology) claimSubnet() (string, error) {
	lock, err := os.OpenFile(filepath.Join(os.TempDir(), "infernode-netem.lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return "", fmt.Errorf("netem: subnet lock: %w", err)
	}
	defer lock.Close() // releases the lock
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX); err != nil {
		return "", fmt.Errorf("netem: subnet lock: %w", err)
	}
	addrs, err := exec.Command("ip", "-o", "-4", "addr", "show").Output()
	if err != nil {
		return "", fmt.Errorf("netem: list addresses: %w", err)
	}
	routes, err := exec.Command("ip", "-o", "-4", "route", "show", "table", "all").Output()
	if err != nil {
		return "", fmt.Errorf("netem: list routes: %w", err)
	}
	used := map[string]bool{}
	for _, m := range inTestRange.FindAllStringSubmatch(string(addrs)+string(routes), -1) {
		used[m[1]] = true
	}
	for x := range 256 {
		if used[strconv.Itoa(x)] {
			continue
		}
		pre := fmt.Sprintf("%s%d.", testRange, x)
		if err := run("ip", "addr", "add", pre+"1/24", "dev", t.bridge); err != nil {
			return "", err
		}
		t.Subnet, t.DriverIP = pre+"0/24", pre+"1"
		return pre, nil
	}
	return "", fmt.Errorf("netem: every /24 of %s0.0/16 is taken on this machine", testRange)
}

// Close removes everything the topology created. It is safe to call twice.
func (t *Topology) Close() {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !t.closed {
		t.closed = true
		for _, h := range t.Nodes {
			h.healDelays()
		}
		Cleanup(t.prefix)
	}
}

// Cleanup removes every namespace and link whose name starts with prefix: leftovers of a
// run that was killed before it could tear down. It is idempotent.
func Cleanup(prefix string) {
	out, _ := exec.Command("ip", "netns", "list").Output()
	for _, line := range strings.Split(string(out), "\n") {
		if f := strings.Fields(line); len(f) > 0 && strings.HasPrefix(f[0], prefix+"-n") {
			run("ip", "netns", "del", f[0])
		}
	}
	out, _ = exec.Command("ip", "-o", "link", "show").Output()
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 {
			continue
		}
		name, _, _ := strings.Cut(strings.TrimSuffix(f[1], ":"), "@")
		if strings.HasPrefix(name, prefix+"br") || strings.HasPrefix(name, prefix+"v") {
			run("ip", "link", "del", name)
		}
	}
}

// Command wraps a command so it runs inside the host's namespace.
func (h *Host) Command(name string, args ...string) []string {
	return append([]string{"ip", "netns", "exec", h.NS, name}, args...)
}

// Isolate cuts the host off from the given hosts, both ways (all other hosts when none
// are given). The test driver on the bridge still reaches it.
func (h *Host) Isolate(from ...*Host) error {
	if len(from) == 0 {
		for _, o := range h.t.Nodes {
			if o != h {
				from = append(from, o)
			}
		}
	}
	for _, o := range from {
		if err := h.nft(fmt.Sprintf("add rule inet netem in ip saddr %s drop", o.IP)); err != nil {
			return err
		}
		if err := h.nft(fmt.Sprintf("add rule inet netem out ip daddr %s drop", o.IP)); err != nil {
			return err
		}
	}
	return nil
}

// DropTo drops packets from this host to another one only (a one-way partition: the
// other still reaches this host).
func (h *Host) DropTo(o *Host) error {
	return h.nft(fmt.Sprintf("add rule inet netem out ip daddr %s drop", o.IP))
}

// Loss drops percent of the packets the host sends to other hosts (not to the driver on
// the bridge).
func (h *Host) Loss(percent int) error {
	match := fmt.Sprintf("add rule inet netem out ip daddr %s ip daddr != %s", h.t.Subnet, h.t.DriverIP)
	switch {
	case percent < 0 || percent > 100:
		return fmt.Errorf("netem: loss must be 0..100%%, got %d", percent)
	case percent == 0:
		return nil
	case percent == 100:
		return h.nft(match + " drop")
	}
	return h.nft(fmt.Sprintf("%s numgen random mod 100 < %d counter drop", match, percent))
}

// Bandwidth caps what the host sends at kbit kilobits a second (tbf). The bucket holds
// 10ms of the rate (at least 32 kbit): tbf refills it on timer ticks, and with a fixed 4 KB
// bucket a 1 Gbit/s cap carried 446-482 Mbit/s (TestBandwidthRate).
func (h *Host) Bandwidth(kbit int) error {
	return run("ip", "netns", "exec", h.NS, "tc", "qdisc", "replace", "dev", "eth0", "root", "tbf",
		"rate", fmt.Sprintf("%dkbit", kbit), "burst", fmt.Sprintf("%dkbit", max(32, kbit/100)), "latency", "400ms")
}

// Dropped is how many packets the host's loss rule has dropped since Loss was called.
func (h *Host) Dropped() (int, error) {
	out, err := exec.Command("ip", "netns", "exec", h.NS, "nft", "list", "chain", "inet", "netem", "out").Output()
	if err != nil {
		return 0, fmt.Errorf("netem: list %s's rules: %w", h.NS, err)
	}
	n := 0
	for _, line := range strings.Split(string(out), "\n") {
		if f := strings.Fields(line); slices.Contains(f, "numgen") {
			for i := range f {
				if f[i] == "packets" && i+1 < len(f) {
					v, err := strconv.Atoi(f[i+1])
					if err != nil {
						return 0, fmt.Errorf("netem: counter in %q: %w", line, err)
					}
					n += v
				}
			}
		}
	}
	return n, nil
}

// Heal removes every fault from the host.
func (h *Host) Heal() error {
	run("ip", "netns", "exec", h.NS, "tc", "qdisc", "del", "dev", "eth0", "root")
	return errors.Join(h.healDelays(), h.nft("flush chain inet netem in"), h.nft("flush chain inet netem out"))
}

// HealAll heals every host.
func (t *Topology) HealAll() error {
	var errs []error
	for _, h := range t.Nodes {
		errs = append(errs, h.Heal())
	}
	return errors.Join(errs...)
}

func (h *Host) nft(rule string) error {
	return run("ip", "netns", "exec", h.NS, "nft", rule)
}

func run(args ...string) error {
	cmd := exec.Command(args[0], args[1:]...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return nil
}

package testbed

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/infernode/infernode/netem"
)

// Config describes a cluster to launch.
type Config struct {
	Binary string // path of the infernode binary
	Model  string // GGUF model every node serves
	// Models, if set, makes a cluster of several models: node i serves Models[i mod
	// len(Models)], and Model is only the default for nodes added beyond them.
	Models []string
	Nodes  int
	// HTTPPort and GossipPort are the first node's ports; node i adds i. Zero lets every
	// node pick free ports (they are read back from the node's log).
	HTTPPort, GossipPort int
	// Args are extra flags for every node.
	Args []string
	// Engine are flags of the engine's layout (--kv-unified=false, --flash-attn=false, a
	// KV cache type, the --ctx a layout needs) for every node, winning over Args, and for
	// the reference node too: its answers are the same text as a node's only on the same
	// arithmetic.
	Engine []string
	// Secret is the cluster secret every node gets (through INFERNODE_CLUSTER_SECRET, so
	// it does not show in process listings). Empty: Start makes a random one.
	Secret string
	// APIKey, if set, is the API key every node requires of clients (through
	// INFERNODE_API_KEY); the cluster's own requests carry it.
	APIKey string
	// Topology, if set, runs node i in host i's network namespace (on the host's
	// address, ports 8080 and 7946) instead of on loopback.
	Topology *netem.Topology
	// LogDir keeps each node's log (node-ID.log). Empty: a temporary directory.
	LogDir string
	// Echo, if set, receives every line every node logs.
	Echo io.Writer
	// Upgrade is the binary an "upgrade" fault restarts a node with (see Fault): the
	// cluster starts on Binary.
	Upgrade string
	// Pin runs node i on CPU i modulo the machine's CPUs (taskset), so that on one machine
	// each node stands for a machine of its own.
	Pin bool
}

// Cluster is a running set of infernode processes.
type Cluster struct {
	cfg   Config
	Nodes []*Node
	http  *http.Client
	// flight counts the workload's streams in flight by serving node (nil outside a run).
	flight *flight
}

// Node is one infernode process (and its restarts).
type Node struct {
	ID         string
	Model      string      // the GGUF file it serves
	Host       *netem.Host // its namespace, or nil on loopback
	HTTPAddr   string      // host:port of its API
	GossipAddr string      // host:port of its gossip
	args       []string
	binary     string // the infernode binary it runs (Config.Binary, until upgraded)
	cfg        *Config
	standalone bool   // not a cluster member: reports no gossip address
	pin        string // the CPUs it is pinned to, as taskset takes them (empty: none)

	mu      sync.Mutex
	cmd     *exec.Cmd
	done    chan struct{}
	err     error
	leaving bool      // sent SIGTERM: draining, not an entry for new requests
	ready   bool      // its /readyz has answered 200 since it started
	cpu     *cpuLimit // see LimitCPU
}

// Start launches the cluster: the first node, then the others joining it.
func Start(ctx context.Context, cfg Config) (*Cluster, error) {
	if cfg.Model == "" && len(cfg.Models) > 0 {
		cfg.Model = cfg.Models[0]
	}
	if cfg.Nodes < 1 || cfg.Binary == "" || cfg.Model == "" {
		return nil, errors.New("testbed: binary, model and at least one node are required")
	}
	if cfg.LogDir == "" {
		dir, err := os.MkdirTemp("", "infernode-testbed")
		if err != nil {
			return nil, err
		}
		cfg.LogDir = dir
	} else if err := os.MkdirAll(cfg.LogDir, 0o755); err != nil {
		return nil, err
	}
	if cfg.Secret == "" {
		var b [24]byte
		rand.Read(b[:])
		cfg.Secret = hex.EncodeToString(b[:])
	}
	c := &Cluster{cfg: cfg, http: &http.Client{Timeout: 5 * time.Second}}
	for i := range cfg.Nodes {
		if _, err := c.Add(ctx, fmt.Sprintf("node%d", i+1)); err != nil {
			c.Close()
			return nil, err
		}
	}
	return c, nil
}

// Add starts one more node that joins the cluster (or starts it, if it is the first).
func (c *Cluster) Add(ctx context.Context, id string, extra ...string) (*Node, error) {
	i := len(c.Nodes)
	port := func(base int) int {
		if base == 0 {
			return 0
		}
		return base + i
	}
	model := c.cfg.Model
	if len(c.cfg.Models) > 0 && i < c.cfg.Nodes {
		model = c.cfg.Models[i%len(c.cfg.Models)]
	}
	args := []string{"--model", model, "--id", id, "--log-format", "json",
		"--addr", fmt.Sprintf("127.0.0.1:%d", port(c.cfg.HTTPPort)),
		"--gossip-addr", fmt.Sprintf("127.0.0.1:%d", port(c.cfg.GossipPort))}
	var host *netem.Host
	if t := c.cfg.Topology; t != nil {
		if i >= len(t.Nodes) {
			return nil, fmt.Errorf("testbed: the topology has %d hosts, node %d needs one more", len(t.Nodes), i+1)
		}
		host = t.Nodes[i]
		args = []string{"--model", model, "--id", id, "--log-format", "json",
			"--addr", host.IP + ":8080", "--gossip-addr", host.IP + ":7946"}
	}
	if i > 0 {
		args = append(args, "--join", c.Nodes[0].GossipAddr)
	}
	args = slices.Concat(args, c.cfg.Args, extra, c.cfg.Engine)
	n := &Node{ID: id, Model: model, args: args, binary: c.cfg.Binary, cfg: &c.cfg, Host: host}
	if c.cfg.Pin {
		n.pin = strconv.Itoa(i % runtime.NumCPU())
	}
	if err := n.start(ctx); err != nil {
		return nil, err
	}
	c.Nodes = append(c.Nodes, n)
	return n, nil
}

// logPath is the file the node's output goes to, over all its starts.
func (n *Node) logPath() string { return filepath.Join(n.cfg.LogDir, "node-"+n.ID+".log") }

// start runs the process and waits until it reports its addresses.
func (n *Node) start(ctx context.Context) error {
	logf, err := os.OpenFile(n.logPath(), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	argv := append([]string{n.binary}, n.args...)
	if n.pin != "" {
		argv = append([]string{"taskset", "-c", n.pin}, argv...) // taskset execs: the pid is the node's
	}
	if n.Host != nil {
		argv = n.Host.Command(n.binary, n.args...) // ip netns exec execs: the pid is the node's
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = os.Environ()
	if !n.standalone {
		cmd.Env = append(cmd.Env, "INFERNODE_CLUSTER_SECRET="+n.cfg.Secret)
	}
	if n.cfg.APIKey != "" {
		cmd.Env = append(cmd.Env, "INFERNODE_API_KEY="+n.cfg.APIKey)
	}
	// Its own process group: a Ctrl-C meant for the testbed does not reach the nodes
	// directly, so the testbed decides how they stop.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	stderr, err := cmd.StderrPipe()
	if err != nil {
		logf.Close()
		return err
	}
	cmd.Stdout = logf
	if err := cmd.Start(); err != nil {
		logf.Close()
		return fmt.Errorf("start %s: %w", n.ID, err)
	}
	done := make(chan struct{})
	n.mu.Lock()
	n.cmd, n.done, n.leaving, n.ready = cmd, done, false, false
	n.mu.Unlock()
	addrs := make(chan [2]string, 2)
	go func() {
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			line := sc.Bytes()
			logf.Write(append(line, '\n'))
			if n.cfg.Echo != nil {
				fmt.Fprintf(n.cfg.Echo, "%s: %s\n", n.ID, line)
			}
			var l struct{ Msg, Addr string }
			if json.Unmarshal(line, &l) == nil && (l.Msg == "serving" || l.Msg == "gossip started") {
				addrs <- [2]string{l.Msg, l.Addr}
			}
		}
		err := cmd.Wait()
		logf.Close()
		n.mu.Lock()
		n.err = err
		n.mu.Unlock()
		close(done)
	}()
	var httpAddr, gossipAddr string
	deadline := time.After(60 * time.Second)
	for httpAddr == "" || (gossipAddr == "" && !n.standalone) {
		select {
		case a := <-addrs:
			if a[0] == "serving" {
				httpAddr = a[1]
			} else {
				gossipAddr = a[1]
			}
		case <-done:
			return fmt.Errorf("%s exited during start-up: %v (log in %s)", n.ID, n.Err(), n.cfg.LogDir)
		case <-deadline:
			n.Kill()
			return fmt.Errorf("%s did not report its addresses within 60s", n.ID)
		case <-ctx.Done():
			n.Kill()
			return ctx.Err()
		}
	}
	n.mu.Lock()
	n.HTTPAddr, n.GossipAddr = httpAddr, gossipAddr
	n.mu.Unlock()
	return nil
}

// URL is the node's API base URL.
func (n *Node) URL() string {
	n.mu.Lock()
	defer n.mu.Unlock()
	return "http://" + n.HTTPAddr
}

// Err is the process's exit error, once it has exited.
func (n *Node) Err() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.err
}

// Running reports whether the process has not exited.
func (n *Node) Running() bool {
	n.mu.Lock()
	done := n.done
	n.mu.Unlock()
	select {
	case <-done:
		return false
	default:
		return true
	}
}

func (n *Node) signal(sig syscall.Signal) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.cmd == nil || n.cmd.Process == nil {
		return errors.New("not started")
	}
	n.leaving = n.leaving || sig == syscall.SIGTERM
	return n.cmd.Process.Signal(sig)
}

// isLeaving reports whether the node was told to leave (SIGTERM) since it last started.
func (n *Node) isLeaving() bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.leaving
}

// Serving reports whether the node takes new requests, as a client's load balancer sees
// it: running, its /readyz has said 200 since it started (a node that just joined loads
// its model first), and not told to leave (a draining node's /readyz says 503).
func (n *Node) Serving() bool {
	n.mu.Lock()
	leaving, ready := n.leaving, n.ready
	n.mu.Unlock()
	if leaving || !n.Running() {
		return false
	}
	if !ready {
		resp, err := readyClient.Get(n.URL() + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		n.mu.Lock()
		n.ready = resp.StatusCode == 200
		ready = n.ready
		n.mu.Unlock()
	}
	return ready
}

var readyClient = &http.Client{Timeout: time.Second}

// WaitServing polls the node until it serves (see Serving): Start returns once it listens,
// which may be before its model is loaded and warmed.
func (n *Node) WaitServing(ctx context.Context, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for !n.Serving() {
		select {
		case <-ctx.Done():
			return fmt.Errorf("testbed: %s not serving within %v", n.ID, timeout)
		case <-tick.C:
		}
	}
	return nil
}

// Pid is the node's process id (and its process group's: every node leads its own), 0
// before it starts.
func (n *Node) Pid() int {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.cmd == nil || n.cmd.Process == nil {
		return 0
	}
	return n.cmd.Process.Pid
}

// Kill sends SIGKILL and waits for the process to exit.
func (n *Node) Kill() {
	n.signal(syscall.SIGKILL)
	n.wait(30 * time.Second)
}

// Stop sends SIGTERM (graceful leave and drain) and waits up to timeout for the exit.
func (n *Node) Stop(timeout time.Duration) error {
	if !n.Running() {
		return nil
	}
	if err := n.signal(syscall.SIGTERM); err != nil {
		return err
	}
	if !n.wait(timeout) {
		n.Kill()
		return fmt.Errorf("%s did not exit within %v of SIGTERM", n.ID, timeout)
	}
	return n.Err()
}

// Pause stops the process (SIGSTOP): alive, but answering nothing. Resume continues it.
func (n *Node) Pause() error  { return n.signal(syscall.SIGSTOP) }
func (n *Node) Resume() error { return n.signal(syscall.SIGCONT) }

func (n *Node) wait(timeout time.Duration) bool {
	n.mu.Lock()
	done := n.done
	n.mu.Unlock()
	select {
	case <-done:
		return true
	case <-time.After(timeout):
		return false
	}
}

// Restart starts the node again with the same id and flags (after Kill or Stop), on the
// addresses it had: peers keep re-joining the seed addresses they were given, so a
// restarted seed must come back where they look for it.
func (n *Node) Restart(ctx context.Context) error {
	if n.Running() {
		return fmt.Errorf("%s is still running", n.ID)
	}
	n.Unlimit() // the limit was the old process's
	n.mu.Lock()
	for i := 0; i+1 < len(n.args); i++ {
		switch n.args[i] {
		case "--addr":
			n.args[i+1] = n.HTTPAddr
		case "--gossip-addr":
			n.args[i+1] = n.GossipAddr
		}
	}
	n.mu.Unlock()
	return n.start(ctx)
}

// Secret is the cluster secret every node was given.
func (c *Cluster) Secret() string { return c.cfg.Secret }

// Close kills every node.
func (c *Cluster) Close() {
	for _, n := range c.Nodes {
		if n.Running() {
			n.Resume()
			n.Kill()
		}
		n.Unlimit()
	}
}

// ClusterView is GET /v1/cluster as a node answers it.
type ClusterView struct {
	Self    string       `json:"self"`
	Members []MemberView `json:"members"`
}

// MemberView is one member of a ClusterView.
type MemberView struct {
	ID          string         `json:"id"`
	HTTPAddr    string         `json:"http_addr"`
	Model       string         `json:"model"`
	Role        string         `json:"role"` // both, decode or prefill
	Fingerprint string         `json:"fingerprint"`
	State       string         `json:"state"`
	Healthy     bool           `json:"healthy"`
	Ready       bool           `json:"ready"`
	Compatible  bool           `json:"compatible"` // may share the node's ring: its model
	OnRing      bool           `json:"on_ring"`    // on its model's ring
	RingShare   float64        `json:"ring_share"`
	Load        map[string]int `json:"load"`     // running, waiting, free_kv
	Degraded    bool           `json:"degraded"` // most of the cluster finds it slow
	// PrefixDigest is how full its gossiped digest of the prompt beginnings it holds is
	// (the share of its bits set): 0 while it holds none.
	PrefixDigest float64 `json:"prefix_digest"`
}

// View asks a node for its view of the cluster.
func (c *Cluster) View(n *Node) (ClusterView, error) {
	var v ClusterView
	return v, c.getJSON(n, "/v1/cluster", &v)
}

// getJSON decodes a node's answer to GET path (with the operator's key) into v.
func (c *Cluster) getJSON(n *Node, path string, v any) error {
	req, err := http.NewRequest("GET", n.URL()+path, nil)
	if err != nil {
		return err
	}
	if c.cfg.APIKey != "" {
		req.Header.Set("Authorization", "Bearer "+c.cfg.APIKey)
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		return fmt.Errorf("%s: %s answered %d", n.ID, path, resp.StatusCode)
	}
	return json.NewDecoder(resp.Body).Decode(v)
}

// Ring is the sorted ids on a node's ring (its own model's).
func (c *Cluster) Ring(n *Node) ([]string, error) {
	v, err := c.View(n)
	if err != nil {
		return nil, err
	}
	var ids []string
	for _, m := range v.Members {
		if m.OnRing && m.Compatible {
			ids = append(ids, m.ID)
		}
	}
	slices.Sort(ids)
	return ids, nil
}

// WaitRings polls every running node (except those in skip) until its ring is exactly
// want, and returns how long that took.
func (c *Cluster) WaitRings(ctx context.Context, want []string, timeout time.Duration, skip ...*Node) (time.Duration, error) {
	want = slices.Clone(want)
	slices.Sort(want)
	start := time.Now()
	deadline := start.Add(timeout)
	for {
		all := true
		var last string
		for _, n := range c.Nodes {
			if slices.Contains(skip, n) || !n.Running() || n.isLeaving() {
				continue // a node told to leave may still be draining: its view no longer counts
			}
			got, err := c.Ring(n)
			if err != nil || !slices.Equal(got, want) {
				all, last = false, fmt.Sprintf("%s sees %v (err %v)", n.ID, got, err)
				break
			}
		}
		if all {
			return time.Since(start), nil
		}
		if time.Now().After(deadline) {
			return time.Since(start), fmt.Errorf("rings did not converge on %v within %v: %s", want, timeout, last)
		}
		select {
		case <-ctx.Done():
			return time.Since(start), ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// WaitDropped polls every other running node until none has n on its ring (a node cut off
// by a partition passes as soon as n is off its own ring), and returns how long that took.
func (c *Cluster) WaitDropped(ctx context.Context, n *Node, timeout time.Duration) (time.Duration, error) {
	start := time.Now()
	for {
		var holding []string
		for _, o := range c.Nodes {
			if o == n || !o.Running() {
				continue
			}
			ring, err := c.Ring(o)
			if err != nil || slices.Contains(ring, n.ID) {
				holding = append(holding, fmt.Sprintf("%s (ring %v, err %v)", o.ID, ring, err))
			}
		}
		if len(holding) == 0 {
			return time.Since(start), nil
		}
		if time.Since(start) > timeout {
			return time.Since(start), fmt.Errorf("%s still on the rings of %v after %v", n.ID, holding, timeout)
		}
		select {
		case <-ctx.Done():
			return time.Since(start), ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// Node is the node of id, or nil.
func (c *Cluster) Node(id string) *Node {
	for _, n := range c.Nodes {
		if n.ID == id {
			return n
		}
	}
	return nil
}

// IDs are the ids of the given nodes (all nodes when none are given).
func (c *Cluster) IDs(nodes ...*Node) []string {
	if len(nodes) == 0 {
		nodes = c.Nodes
	}
	var ids []string
	for _, n := range nodes {
		ids = append(ids, n.ID)
	}
	return ids
}

// ByModel groups the nodes by the model they serve, in the order the models first appear.
func (c *Cluster) ByModel() [][]*Node {
	var groups [][]*Node
	at := map[string]int{}
	for _, n := range c.Nodes {
		i, ok := at[n.Model]
		if !ok {
			i = len(groups)
			at[n.Model] = i
			groups = append(groups, nil)
		}
		groups[i] = append(groups[i], n)
	}
	return groups
}

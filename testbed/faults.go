package testbed

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"syscall"
	"time"

	"github.com/infernode/infernode/netem"
)

// Faults: what a scenario does to its cluster (kill, pause, cut off, slow down, leave,
// join), as it happened, and the windows in which each node was faulted.

// Fault is one scheduled action on the cluster.
type Fault struct {
	At time.Duration `json:"at"`
	// kill, restart, pause, resume, leave, join, isolate, halves, oneway, loss, bandwidth,
	// delay (Amount ms ± a fifth, to every peer), slowlink (Amount ms ± a tenth, from
	// Node to Peer only), cpu (Node held to Amount percent of one CPU), heal (every
	// network fault and CPU limit), upgrade (a restart on Config.Upgrade's binary, once the
	// node has exited: after a leave, it waits up to 30s for the drain).
	Kind string `json:"kind"`
	// Node is an index into the cluster's nodes (join: ignored). Busiest aims a kill, pause,
	// isolate or leave at the node serving the most streams in flight, so the fault lands
	// mid-answer; on a restart or resume it names the node the last Busiest fault chose.
	Node   int `json:"node"`
	Peer   int `json:"peer,omitempty"`
	Amount int `json:"amount,omitempty"` // loss percent, bandwidth kbit, delay ms
	// Detect bounds how long the other nodes' rings may take to agree with the fault
	// (drop the node, or take it back); 0 means the kind's default (see detectBound).
	Detect time.Duration `json:"detect_ns,omitempty"`
}

// Busiest, as a Fault's Node, aims it at the owner of the most streams in flight.
const Busiest = -1

func (f Fault) String() string {
	node := fmt.Sprintf("node%d", f.Node+1)
	if f.Node == Busiest {
		node = "busiest owner"
	}
	s := fmt.Sprintf("%v %s %s", f.At, f.Kind, node)
	if f.Kind == "oneway" || f.Kind == "slowlink" {
		s += fmt.Sprintf("->node%d", f.Peer+1)
	}
	if f.Amount != 0 {
		s += fmt.Sprintf(" %d", f.Amount)
	}
	return s
}

// detectBound is how long the rings may take to agree with f.
func detectBound(f Fault) time.Duration {
	if f.Detect > 0 {
		return f.Detect
	}
	switch f.Kind {
	case "kill":
		return 3 * time.Second // refused at once: 3 failed probes 500ms apart, or gossip's suspicion
	case "pause", "isolate":
		// Silent: 3 probe rounds of up to the 600ms probe timeout (a 200ms link must not
		// look dead), or gossip's suspicion: 2-3s measured.
		return 3500 * time.Millisecond
	case "leave":
		return 2 * time.Second // announced in gossip: one or two gossip rounds
	default:
		return 6 * time.Second // back on every ring: process start, model load, 2 probes, gossip
	}
}

// Applied is a fault as it happened.
type Applied struct {
	Fault   Fault     `json:"fault"`
	Time    time.Time `json:"time"`
	Backend string    `json:"backend"` // signal, nftables, tbf, netem, process
	Err     string    `json:"error,omitempty"`
	// Detection is how long until every other running node's ring agreed with the fault
	// (kill, pause, isolate, leave) or its healing (restart, resume, heal, join); 0 if
	// not measured.
	Detection time.Duration `json:"detection_ns,omitempty"`
	// Measured says whether this fault's effect on the rings is measured (and bounded).
	Measured bool `json:"measured"`
	// Aim says what a Busiest fault found on the node it chose.
	Aim string `json:"aim,omitempty"`
	// DetectErr says why the rings did not agree with the fault within its bound.
	DetectErr string `json:"detect_error,omitempty"`
	// Unsupported says why this machine could not apply the fault (it is reported, and
	// changes nothing).
	Unsupported string `json:"unsupported,omitempty"`
}

// running is the nodes running now.
func (c *Cluster) running() []*Node {
	return slices.DeleteFunc(slices.Clone(c.Nodes), func(n *Node) bool { return !n.Running() })
}

// serving are the nodes that take new requests (see Node.Serving).
func (c *Cluster) serving() []*Node {
	return slices.DeleteFunc(slices.Clone(c.Nodes), func(n *Node) bool { return !n.Serving() })
}

// busiest picks the node a Busiest fault aims at: for a restart or resume, the node the
// last one chose; otherwise the running node serving the most streams in flight (with at
// least half their tokens to come), waiting up to 2s for one to have any.
func (c *Cluster) busiest(ctx context.Context, kind string, last int) (int, string) {
	if kind == "restart" || kind == "resume" || kind == "heal" {
		return max(last, 0), ""
	}
	deadline := time.Now().Add(2 * time.Second)
	for {
		id, n := c.flight.busiest(c.runningIDs())
		if n > 0 {
			for i, node := range c.Nodes {
				if node.ID == id {
					return i, fmt.Sprintf("%s served %d forwarded streams", id, n)
				}
			}
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return 0, "no forwarded stream in flight within 2s: node1 by default"
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// apply carries out one fault. It returns at once (so the schedule keeps time) with a
// function that measures how long the other nodes' rings take to agree with the fault.
func (c *Cluster) apply(ctx context.Context, f Fault) (Applied, func() (time.Duration, error)) {
	a := Applied{Fault: f, Time: time.Now(), Backend: "signal"}
	bound := detectBound(f)
	if f.Kind == "join" {
		a.Backend = "process"
		_, err := c.Add(ctx, fmt.Sprintf("node%d", len(c.Nodes)+1))
		if err != nil {
			a.Err = err.Error()
			return a, nil
		}
		a.Fault.Node, a.Measured = len(c.Nodes)-1, true
		// A node told to leave may still be draining: it is off the rings already (the
		// leave's own expectation) and is not expected back on them.
		want := c.stayingIDs()
		return a, func() (time.Duration, error) { return c.WaitRings(ctx, want, bound) }
	}
	if f.Node >= len(c.Nodes) {
		a.Err = "no such node"
		return a, nil
	}
	n := c.Nodes[f.Node]
	var err error
	var expectWithout, expectAll bool
	switch f.Kind {
	case "kill":
		n.Kill()
		expectWithout = true
	case "pause":
		err, expectWithout = n.Pause(), true
	case "resume":
		err, expectAll = n.Resume(), true
	case "restart":
		a.Backend = "process"
		err, expectAll = n.Restart(ctx), true
	case "upgrade":
		a.Backend = "process (" + filepath.Base(c.cfg.Upgrade) + ")"
		switch {
		case c.cfg.Upgrade == "":
			err = errors.New("no binary to upgrade to (Config.Upgrade)")
		case !n.wait(30 * time.Second):
			err = fmt.Errorf("%s still running 30s after the upgrade began", n.ID)
		default:
			n.mu.Lock()
			n.binary = c.cfg.Upgrade
			n.mu.Unlock()
			err, expectAll = n.Restart(ctx), true
		}
	case "leave":
		a.Backend = "signal (SIGTERM)"
		err, expectWithout = n.signal(syscall.SIGTERM), true
	case "cpu":
		a.Backend, err = n.LimitCPU(f.Amount, CPUPeriod)
		if err != nil && a.Backend != "" { // fell back to another backend: say why, go on
			a.Backend, err = a.Backend+" ("+err.Error()+")", nil
		}
	case "heal":
		for _, o := range c.Nodes {
			err = errors.Join(err, o.Unlimit())
		}
		a.Backend, expectAll = "cgroup", true
		if c.cfg.Topology != nil {
			a.Backend, err = "nftables, iptables, cgroup", errors.Join(err, c.cfg.Topology.HealAll())
		}
	case "isolate", "halves", "oneway", "loss", "bandwidth", "delay", "slowlink":
		if n.Host == nil {
			a.Backend, a.Err = "none", "network faults need a namespace topology"
			return a, nil
		}
		a.Backend = "nftables"
		switch f.Kind {
		case "isolate":
			err, expectWithout = n.Host.Isolate(), true
		case "halves":
			var other []*netem.Host
			for _, o := range c.Nodes[len(c.Nodes)/2:] {
				other = append(other, o.Host)
			}
			for _, h := range c.Nodes[:len(c.Nodes)/2] {
				err = errors.Join(err, h.Host.Isolate(other...))
			}
		case "oneway":
			err = n.Host.DropTo(c.Nodes[f.Peer].Host)
		case "loss":
			err = n.Host.Loss(f.Amount)
		case "bandwidth":
			a.Backend, err = "tbf", n.Host.Bandwidth(f.Amount)
		case "delay":
			a.Backend, err = n.Host.Delay(netem.Shape{Delay: time.Duration(f.Amount) * time.Millisecond,
				Jitter: time.Duration(f.Amount) * time.Millisecond / 5})
		case "slowlink":
			a.Backend, err = n.Host.Delay(netem.Shape{Delay: time.Duration(f.Amount) * time.Millisecond,
				Jitter: time.Duration(f.Amount) * time.Millisecond / 10}, c.Nodes[f.Peer].Host)
		}
	default:
		err = fmt.Errorf("unknown fault %q", f.Kind)
	}
	if errors.Is(err, netem.ErrUnsupported) {
		a.Unsupported = err.Error()
		return a, nil
	}
	a.Err = errString(err)
	if err != nil {
		return a, nil
	}
	switch {
	case expectWithout:
		a.Measured = true
		return a, func() (time.Duration, error) { return c.WaitDropped(ctx, n, bound) }
	case expectAll:
		a.Measured = true
		return a, func() (time.Duration, error) { return c.WaitRings(ctx, c.stayingIDs(), bound) }
	}
	return a, nil
}

// windows are the spans in which each node was faulted: a kill, pause, leave or network
// fault opens one; the restart, resume or heal that undoes it closes it once every ring
// agreed (its measured detection). A node that left, or was never healed, stays faulted to
// the end. A network fault touches the nodes on both sides of what it cuts.
func windows(applied []Applied, c *Cluster, end time.Time) []Window {
	open := map[string]Window{}
	var out []Window
	closeAll := func(pred func(w Window) bool, at time.Time) {
		for id, w := range open {
			if pred(w) {
				w.To = at
				out = append(out, w)
				delete(open, id)
			}
		}
	}
	healable := []string{"isolate", "halves", "oneway", "loss", "bandwidth", "delay", "slowlink", "cpu"}
	for _, a := range applied {
		if a.Err != "" || a.Unsupported != "" {
			continue
		}
		f := a.Fault
		healed := a.Time.Add(a.Detection)
		if !a.Measured || a.Detection == 0 {
			healed = a.Time.Add(detectBound(f))
		}
		var touched []string
		switch f.Kind {
		case "kill", "pause", "leave", "isolate", "loss", "bandwidth", "delay", "cpu":
			touched = []string{c.Nodes[f.Node].ID}
		case "oneway", "slowlink":
			touched = []string{c.Nodes[f.Node].ID, c.Nodes[f.Peer].ID}
		case "halves":
			touched = c.IDs()
		case "restart", "resume", "upgrade":
			id := c.Nodes[f.Node].ID
			closeAll(func(w Window) bool { return w.Node == id }, healed)
		case "heal":
			closeAll(func(w Window) bool { return slices.Contains(healable, w.Kind) }, healed)
		}
		for _, id := range touched {
			if _, ok := open[id]; !ok {
				open[id] = Window{Node: id, Kind: f.Kind, From: a.Time}
			}
		}
	}
	closeAll(func(Window) bool { return true }, end)
	slices.SortFunc(out, func(a, b Window) int { return a.From.Compare(b.From) })
	return out
}

// faulted reports whether node was in a fault window overlapping [from, to].
func faulted(ws []Window, node string, from, to time.Time) bool {
	for _, w := range ws {
		if w.Node == node && overlaps(from, to, w.From, w.To) {
			return true
		}
	}
	return false
}

// overlaps says whether the spans [from, to] and [a, b] overlap, beyond touching at an end.
func overlaps(from, to, a, b time.Time) bool { return from.Before(b) && to.After(a) }

// stayingIDs are the running nodes not told to leave.
func (c *Cluster) stayingIDs() []string {
	var ids []string
	for _, n := range c.Nodes {
		if n.Running() && !n.isLeaving() {
			ids = append(ids, n.ID)
		}
	}
	return ids
}

func (c *Cluster) runningIDs() []string {
	var ids []string
	for _, n := range c.Nodes {
		if n.Running() {
			ids = append(ids, n.ID)
		}
	}
	return ids
}

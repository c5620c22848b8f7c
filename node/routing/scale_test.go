package routing

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/infernode/infernode/internal/poll"
)

// The autoscaler reads the ring's load from gossip: requests waiting, and the KV cells
// that running requests hold (idle conversations' cells may be evicted: no reason to
// grow). KV pressure alone, with nothing waiting, asks for more nodes.
func TestAutoscaleLoad(t *testing.T) {
	c := newCluster(t, "b", "c")
	members := []member{peerMember("b"), peerMember("c")}
	for i := range members {
		members[i].Meta.KVActive, members[i].Meta.KVCells, members[i].Meta.FreeKV = 1900, 2048, 10
	}
	c.members.set(members...)
	c.entry.v.Sync()
	l := c.entry.load()
	if l.Nodes != 3 || l.Waiting != 0 || l.KVUsed != 3800 || l.KVCells != 4096 {
		t.Fatalf("load %+v, want 3 nodes, 3800 of 4096 cells held by running requests (the fake engine reports none)", l)
	}
	c.entry.autoscale(t.Context()) // the controller starts at the ring's count
	c.clock.Advance(time.Minute)   // past the cool-down after a change
	c.entry.autoscale(t.Context())
	if v := c.entry.scale.last; v.Desired <= 3 || v.KVUsed < 0.9 {
		t.Errorf("autoscale %+v: want more than 3 nodes at %.0f%% of KV in use", v, 100*float64(l.KVUsed)/float64(l.KVCells))
	}
}

// TestHookAfterRingChange: the hook's node asks again for a count it asked for before,
// once the ring has changed in between (the autoscale scenario: node1 asked for 2 nodes;
// node2, owning the hook's key in a ring of two, asked for 1 and left; node1, overloaded
// alone, never asked for 2 again), not again at once, and again after a minute unheeded.
func TestHookAfterRingChange(t *testing.T) {
	c := newCluster(t, "b")
	var mu sync.Mutex
	var fired []int
	c.entry.cfg.ScaleHook = func(_ context.Context, current, desired int) {
		mu.Lock()
		defer mu.Unlock()
		fired = append(fired, current, desired)
	}
	calls := func() []int {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(fired)
	}
	c.local.set(script{waiting: 40})
	run := func(after time.Duration) {
		c.clock.Advance(after)
		before := len(calls())
		c.entry.autoscale(t.Context())
		poll.Within(time.Second, time.Millisecond, func() bool { return len(calls()) > before }) // the hook runs on its own goroutine
	}
	alone := func(b bool) {
		if b {
			c.members.set()
		} else {
			c.members.set(peerMember("b"))
		}
		c.entry.v.Sync()
		for range 2 { // a returning member is back on the ring after two good checks
			c.entry.v.ProbeAll(t.Context())
			c.entry.v.Sync()
		}
	}
	alone(true)
	run(35 * time.Second) // the controller starts at the ring's count
	run(35 * time.Second) // past the up cool-down: 1 -> 2
	alone(false)
	run(10 * time.Second) // two nodes: b may own the hook's key
	alone(true)
	run(10 * time.Second) // b left: the controller starts again from 1
	run(30 * time.Second) // past the up cool-down: 1 -> 2 again, 50 s after the first
	run(10 * time.Second) // asked 10 s ago: not again
	run(time.Minute)      // unheeded for a minute: again
	if got := calls(); !slices.Equal(got, []int{1, 2, 1, 2, 1, 2}) {
		t.Errorf("hook calls (current, desired): %v; want 1->2, 1->2 after the ring changed, and again a minute later", got)
	}
}

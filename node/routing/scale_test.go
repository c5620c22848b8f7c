package routing

import (
	"testing"
	"time"
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

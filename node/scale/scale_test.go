package scale

import (
	"testing"
	"time"
)

// TestRampUpAndDown: a load ramp from half a node's set point to four times it and back,
// on a cluster that follows the controller: it scales out while the queue stays above its
// set point, holds in the dead band, scales in after the load falls, and reverses once.
func TestRampUpAndDown(t *testing.T) {
	cfg := DefaultConfig()
	c := New(cfg)
	now := time.Unix(0, 0)
	nodes := 1
	var counts []int
	// The plant: offered load in nodes' worth of work; a node's queue stands at the set
	// point when it gets one node's worth, in proportion otherwise.
	step := func(offered float64) {
		nodes = c.Update(Load{Nodes: nodes, Waiting: offered * cfg.Queue}, now)
		now = now.Add(5 * time.Second)
		if len(counts) == 0 || counts[len(counts)-1] != nodes {
			counts = append(counts, nodes)
		}
	}
	for range 36 { // 3 minutes at half the set point: nothing moves
		step(0.5)
	}
	if nodes != 1 {
		t.Fatalf("at half the set point the cluster grew to %d", nodes)
	}
	for range 120 { // 10 minutes at four times one node's capacity
		step(4)
	}
	peak := nodes
	if peak < 3 {
		t.Fatalf("at four times the set point: %d nodes (counts %v)", peak, counts)
	}
	for range 120 { // back down
		step(0.5)
	}
	if nodes >= peak {
		t.Fatalf("after the load fell: %d nodes (counts %v)", nodes, counts)
	}
	reversals := 0
	for i := 2; i < len(counts); i++ {
		if (counts[i]-counts[i-1])*(counts[i-1]-counts[i-2]) < 0 {
			reversals++
		}
	}
	if reversals > 1 {
		t.Errorf("%d reversals: %v", reversals, counts)
	}
	t.Logf("node counts: %v", counts)
}

// TestAntiWindup: pinned at the maximum under a long overload, the controller comes down
// within 30 s once the load is gone (an integral that wound up would hold it up for
// minutes).
func TestAntiWindup(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Max, cfg.Ki = 3, 1 // an integral that wound up to its bound would hold the output up
	cfg.DownCooldown = 10 * time.Second
	c := New(cfg)
	now := time.Unix(0, 0)
	for range 720 { // an hour of far too much load
		c.Update(Load{Nodes: 3, Waiting: 300}, now)
		now = now.Add(5 * time.Second)
	}
	var d int
	for i := range 6 {
		d = c.Update(Load{Nodes: 3}, now)
		now = now.Add(5 * time.Second)
		if d < 3 {
			t.Logf("scaled in %v after the load ended", time.Duration(i)*5*time.Second)
			return
		}
	}
	t.Errorf("still %d nodes 30 s after the load ended (the integral wound up)", d)
}

// TestCooldown: a change is not followed by another within the cool-downs.
func TestCooldown(t *testing.T) {
	c := New(DefaultConfig())
	now := time.Unix(0, 0)
	// The controller starts from the current count: a rise waits out the cool-down.
	for _, at := range []time.Duration{0, 10 * time.Second} {
		if d := c.Update(Load{Nodes: 2, Waiting: 40}, now.Add(at)); d != 2 {
			t.Errorf("%v after the start: %d nodes wanted, want 2 until the up cool-down (30 s) has passed", at, d)
		}
	}
	if d := c.Update(Load{Nodes: 2, Waiting: 40}, now.Add(40*time.Second)); d <= 2 {
		t.Errorf("no rise past the cool-down under load: %d", d)
	}
}

// TestKVPressure: with nothing waiting, a KV cache held past its set point by running
// requests asks for more nodes, a cache under it does not, and a full one asks for more
// than one only just over.
func TestKVPressure(t *testing.T) {
	want := func(used int) int {
		cfg := DefaultConfig()
		cfg.UpCooldown = 0
		c := New(cfg)
		now := time.Unix(0, 0)
		n := 0
		for range 3 {
			n = c.Update(Load{Nodes: 4, KVUsed: float64(used), KVCells: 1000}, now)
			now = now.Add(5 * time.Second)
		}
		return n
	}
	low, over, full := want(700), want(920), want(1000)
	if low != 4 || over <= 4 || full < over {
		t.Errorf("4 nodes wanted %d at 70%% KV, %d at 92%%, %d at 100%%: want 4, more, at least as many again", low, over, full)
	}
}

// TestScaleInFloor: with nothing waiting, the controller scales in only as far as the
// running requests allow: to the fewest nodes whose slots they fill to at most Busy.
func TestScaleInFloor(t *testing.T) {
	cfg := DefaultConfig()
	cfg.DownCooldown = 0
	c := New(cfg)
	now := time.Unix(0, 0)
	n := 0
	for range 12 { // 4 nodes of 4 slots, 9 requests running: 3 nodes hold them at 75%
		n = c.Update(Load{Nodes: 4, Running: 9, Slots: 16}, now)
		now = now.Add(5 * time.Second)
	}
	if n != 3 {
		t.Errorf("4 nodes with 9 of 16 slots busy, nothing waiting: %d wanted, want 3 (at most 75%% of the slots busy)", n)
	}
}

// TestStabilization: a rise at most doubles the nodes, however long the queue; a quiet
// moment inside the DownCooldown window does not shrink the cluster, a quiet window does.
func TestStabilization(t *testing.T) {
	cfg := DefaultConfig()
	cfg.UpCooldown, cfg.DownCooldown = 0, 30*time.Second
	c := New(cfg)
	now := time.Unix(0, 0)
	c.Update(Load{Nodes: 2}, now)
	now = now.Add(time.Minute)
	if n := c.Update(Load{Nodes: 2, Waiting: 200}, now); n != 4 {
		t.Fatalf("2 nodes, 100 waiting a node: %d wanted, want 4 (double at most)", n)
	}
	c = New(cfg) // without the integral that queue left
	c.Update(Load{Nodes: 4}, now)
	busy := Load{Nodes: 4, Waiting: 8, Running: 16, Slots: 16} // at the set point
	quiet := Load{Nodes: 4, Slots: 16}
	for i := range 12 { // a minute busy with a quiet 5 s every 15 s
		l := busy
		if i%3 == 2 {
			l = quiet
		}
		now = now.Add(5 * time.Second)
		if n := c.Update(l, now); n != 4 {
			t.Fatalf("step %d: %d wanted after a quiet moment, want 4", i, n)
		}
	}
	n := 0
	for range 8 { // 40 s quiet
		now = now.Add(5 * time.Second)
		n = c.Update(quiet, now)
	}
	if n >= 4 {
		t.Errorf("still %d nodes after 40 s quiet", n)
	}
}

// TestMean: the controller's input is the mean of the load sampled over its period, with
// the last sample's size; a queue seen once in ten samples is a tenth of it.
func TestMean(t *testing.T) {
	samples := make([]Load, 10)
	for i := range samples {
		samples[i] = Load{Nodes: 2, Slots: 8, KVCells: 100}
	}
	samples[3].Waiting, samples[3].Running, samples[9].Nodes = 10, 8, 3
	if m := Mean(samples); m.Waiting != 1 || m.Running != 0.8 || m.Nodes != 3 || m.Slots != 8 {
		t.Errorf("mean %+v", m)
	}
}

// TestFollow: after the ring changes, the controller starts again from its size: it asks
// for nothing else until the load says so past a cool-down, and does not fall on the
// strength of what it wanted before.
func TestFollow(t *testing.T) {
	cfg := DefaultConfig()
	cfg.UpCooldown, cfg.DownCooldown = 10*time.Second, 30*time.Second
	c := New(cfg)
	now := time.Unix(0, 0)
	c.Update(Load{Nodes: 2}, now)
	now = now.Add(time.Minute)
	if n := c.Update(Load{Nodes: 2, Waiting: 40}, now); n != 4 {
		t.Fatalf("wanted %d, want 4", n)
	}
	c.Follow(2, now.Add(time.Second)) // another node asked for 2, and the ring has 2
	if n := c.Update(Load{Nodes: 2, Waiting: 40}, now.Add(5*time.Second)); n != 2 {
		t.Errorf("5 s after the ring changed to 2: %d wanted, want 2 until the up cool-down", n)
	}
	if n := c.Update(Load{Nodes: 2, Waiting: 40}, now.Add(15*time.Second)); n != 4 {
		t.Errorf("past the up cool-down, still loaded: %d wanted, want 4", n)
	}
}

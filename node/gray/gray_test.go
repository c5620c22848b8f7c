package gray

import (
	"fmt"
	"maps"
	"slices"
	"testing"
	"time"
)

var t0 = time.Unix(1_800_000_000, 0)

// round records one probe round of the given round trips and judges the peers.
func round(d *Detector, now time.Time, rtts map[string]time.Duration) []Change {
	for id, rtt := range rtts {
		d.Probe(id, rtt)
	}
	return d.Judge(slices.Collect(maps.Keys(rtts)), now)
}

// TestHysteresis: one slow round is noise; a peer slow round after round is slow after
// Enter rounds (give or take the rounds its average takes to pass the margin), and fast
// again after Exit rounds under half the margin.
func TestHysteresis(t *testing.T) {
	cfg := DefaultConfig()
	d := NewDetector(cfg)
	fast, slow := time.Millisecond, 60*time.Millisecond
	for range 5 {
		round(d, t0, map[string]time.Duration{"b": fast, "c": fast, "d": fast})
	}
	round(d, t0, map[string]time.Duration{"b": fast, "c": slow, "d": fast})
	for range 10 { // the noise decays, and its strike leaks away
		round(d, t0, map[string]time.Duration{"b": fast, "c": fast, "d": fast})
	}
	if got := d.Slow(); len(got) != 0 {
		t.Fatalf("one slow round made %v slow", got)
	}
	rounds := 0
	var changes []Change
	for len(d.Slow()) == 0 && rounds < 20 {
		changes = round(d, t0, map[string]time.Duration{"b": fast, "c": fast, "d": slow})
		rounds++
	}
	// d's average passes the margin at its first slow round (60ms against 1ms).
	if got := d.Slow(); !slices.Equal(got, []string{"d"}) || rounds != cfg.Enter {
		t.Fatalf("after %d slow rounds, slow: %v; want [d] after %d", rounds, got, cfg.Enter)
	}
	if len(changes) != 1 || changes[0].Peer != "d" || !changes[0].Slow || changes[0].ProbeMS <= changes[0].ProbeBaseMS {
		t.Errorf("the change that made d slow: %+v", changes)
	}
	if s := d.Speed("d"); !s.Slow || s.ProbeMS < 10 {
		t.Errorf("speed of d: %+v", s)
	}
	rounds = 0
	for len(d.Slow()) > 0 && rounds < 30 {
		round(d, t0, map[string]time.Duration{"b": fast, "c": fast, "d": fast})
		rounds++
	}
	if len(d.Slow()) > 0 || rounds < cfg.Exit {
		t.Fatalf("fast again after %d good rounds (slow: %v), want at least %d", rounds, d.Slow(), cfg.Exit)
	}
	// A peer no longer live is forgotten.
	round(d, t0, map[string]time.Duration{"b": fast, "c": fast})
	if s := d.Speed("d"); s != (Speed{}) {
		t.Errorf("a peer gone is still observed: %+v", s)
	}
}

// TestGaps: the gaps between tokens forwarded to a peer count too, while answers go
// there: a peer whose tokens come slowly is slow, and once none has been observed for
// GapStale, its probes alone judge it.
func TestGaps(t *testing.T) {
	cfg := DefaultConfig()
	d := NewDetector(cfg)
	now := t0
	step := func(gapD time.Duration) {
		now = now.Add(500 * time.Millisecond)
		for _, id := range []string{"b", "c"} {
			d.Gap(id, 2*time.Millisecond, now)
		}
		if gapD > 0 {
			d.Gap("d", gapD, now)
		}
		round(d, now, map[string]time.Duration{"b": time.Millisecond, "c": time.Millisecond, "d": time.Millisecond})
	}
	for range cfg.Enter + 2 {
		step(40 * time.Millisecond)
	}
	if !slices.Contains(d.Slow(), "d") {
		t.Fatal("a peer whose tokens come 20x slower is not slow")
	}
	for range cfg.Exit + 2 {
		step(0) // nothing forwarded to d: its last gaps still count
	}
	if !slices.Contains(d.Slow(), "d") {
		t.Fatal("d's gaps stopped counting before they went stale")
	}
	now = now.Add(GapStale)
	for range cfg.Exit + 2 {
		step(0)
	}
	if slices.Contains(d.Slow(), "d") {
		t.Fatal("d is still slow on gaps that went stale, with probes as fast as the others'")
	}
}

// TestBusyIsNotSlow: long token gaps from a peer that generates more than Busy times the
// others' tokens a second are its load, not slowness; a peer with such gaps that generates
// its share or less is slow, and so is a busy peer whose probes are slow too.
func TestBusyIsNotSlow(t *testing.T) {
	cases := []struct {
		name   string
		busy   float64       // Config.Busy
		tps    float64       // d's tokens a second; b and c generate 100
		probeD time.Duration // d's probe round trip; b and c 1ms
		slow   bool
	}{
		{name: "busy: twice the others' tokens", busy: 1, tps: 200, probeD: time.Millisecond},
		{name: "no excuse when off", busy: 0, tps: 200, probeD: time.Millisecond, slow: true},
		{name: "its share of tokens", busy: 1, tps: 100, probeD: time.Millisecond, slow: true},
		{name: "starved: fewer tokens", busy: 1, tps: 30, probeD: time.Millisecond, slow: true},
		{name: "just above the others, under the factor", busy: 1.5, tps: 140, probeD: time.Millisecond, slow: true},
		{name: "busy, but its probes are slow", busy: 1, tps: 200, probeD: 60 * time.Millisecond, slow: true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := DefaultConfig()
			cfg.Busy = tc.busy
			d := NewDetector(cfg)
			now := t0
			var changes []Change
			for range 3 * cfg.Enter {
				now = now.Add(500 * time.Millisecond)
				d.Gap("b", 3*time.Millisecond, now)
				d.Gap("c", 3*time.Millisecond, now)
				d.Gap("d", 30*time.Millisecond, now)
				d.Work("b", 100)
				d.Work("c", 100)
				d.Work("d", tc.tps)
				changes = append(changes, round(d, now, map[string]time.Duration{"b": time.Millisecond, "c": time.Millisecond, "d": tc.probeD})...)
			}
			if got := slices.Contains(d.Slow(), "d"); got != tc.slow {
				t.Fatalf("d slow: %v, want %v (changes %+v)", got, tc.slow, changes)
			}
			if tc.slow && (changes[0].TPS != tc.tps || changes[0].TPSBase != 100) {
				t.Errorf("the change names tokens a second %g against %g, want %g against 100", changes[0].TPS, changes[0].TPSBase, tc.tps)
			}
		})
	}
}

// TestNoOutlierAlone: with one peer observed there is nothing to compare with, and the
// floor keeps a peer a few milliseconds slower than the others from being an outlier.
func TestNoOutlierAlone(t *testing.T) {
	alone, four := NewDetector(DefaultConfig()), NewDetector(DefaultConfig())
	for range 20 {
		round(alone, t0, map[string]time.Duration{"b": time.Second})
		round(four, t0, map[string]time.Duration{"b": time.Second, "c": time.Millisecond, "d": 5 * time.Millisecond, "e": time.Millisecond})
	}
	if got := alone.Slow(); len(got) != 0 {
		t.Errorf("a peer observed alone is slow: %v", got)
	}
	if got := four.Slow(); !slices.Equal(got, []string{"b"}) {
		t.Errorf("slow: %v, want only b (d is 5x the others, but within the floor)", got)
	}
}

// TestDegraded: a member is degraded when more than half of the live members that
// observe it (all but itself) find it slow.
func TestDegraded(t *testing.T) {
	for _, tc := range []struct {
		mine   []string
		others []Observer
		want   []string
	}{
		{[]string{"d"}, []Observer{{ID: "b"}, {ID: "c"}, {ID: "d"}}, nil},                                // 1 of 3 observers
		{[]string{"d"}, []Observer{{ID: "b", Slow: []string{"d"}}, {ID: "c"}, {ID: "d"}}, []string{"d"}}, // 2 of 3
		{nil, []Observer{{ID: "b", Slow: []string{"c"}}, {ID: "c"}}, nil},                                // 1 of 2: not more than half
		{nil, []Observer{{ID: "b", Slow: []string{"c"}}, {ID: "c", Slow: []string{"c"}}}, nil},           // its own word does not count
		{[]string{"b"}, []Observer{{ID: "b"}}, []string{"b"}},                                            // 1 of 1
	} {
		got := slices.Sorted(maps.Keys(Degraded(tc.mine, tc.others)))
		if !slices.Equal(got, tc.want) {
			t.Errorf("Degraded(%v, %v) = %v, want %v", tc.mine, tc.others, got, tc.want)
		}
	}
}

// TestAside: a degraded owner keeps about Share of its conversations; the others go to
// its successors about evenly, it last; every call orders a key alike.
func TestAside(t *testing.T) {
	owners := []string{"d", "b", "c"}
	kept, took := 0, map[string]int{}
	const n = 20000
	for i := range n {
		key := fmt.Sprint("conv-", i)
		got := Aside(key, owners, 0.25)
		if !slices.Equal(got, Aside(key, owners, 0.25)) {
			t.Fatalf("%s ordered two ways", key)
		}
		if slices.Sort(slices.Clone(got)); !slices.Equal(slices.Sorted(slices.Values(got)), []string{"b", "c", "d"}) {
			t.Fatalf("%s: %v are not the owners reordered", key, got)
		}
		switch {
		case got[0] == "d":
			kept++
		case got[len(got)-1] != "d":
			t.Fatalf("%s: %v, want d last", key, got)
		default:
			took[got[0]]++
		}
	}
	if share := float64(kept) / n; share < 0.23 || share > 0.27 {
		t.Errorf("kept %.3f, want about 0.25", share)
	}
	for id, k := range took {
		if share := float64(k) / float64(n-kept); share < 0.45 || share > 0.55 {
			t.Errorf("%s took %.3f of the rest, want about half", id, share)
		}
	}
}

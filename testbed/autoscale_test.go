package testbed

import (
	"slices"
	"strings"
	"testing"
	"time"
)

// The scenario's checks read its events and samples: counted right, a ramp that grows,
// holds and shrinks reverses once; one that shrinks and grows again under the same load
// reverses more, and fails the check.
func TestAutoscaleChecks(t *testing.T) {
	at := func(s int) time.Time { return time.Unix(int64(s), 0) }
	events := []ScaleEvent{
		{Time: at(10), Kind: "hook", Current: 1, Desired: 2}, {Time: at(10), Kind: "start", Node: "node2"},
		{Time: at(12), Kind: "start", Node: "node3", Detail: "failed to start"},
		{Time: at(30), Kind: "hook", Current: 2, Desired: 3}, {Time: at(30), Kind: "start", Node: "node3"},
		{Time: at(90), Kind: "hook", Current: 3, Desired: 1}, {Time: at(90), Kind: "leave", Node: "node3"}, {Time: at(90), Kind: "leave", Node: "node2"},
	}
	counts := nodeCounts(events, 1)
	if !slices.Equal(counts, []int{1, 2, 3, 2, 1}) || reversals(counts) != 1 {
		t.Errorf("counts %v, %d reversals; want [1 2 3 2 1], 1", counts, reversals(counts))
	}
	if n := reversals([]int{1, 2, 3, 2, 3, 2, 1}); n != 3 {
		t.Errorf("an oscillating ramp: %d reversals, want 3", n)
	}
	if up, ok := firstHook(events, func(e ScaleEvent) bool { return e.Desired > e.Current }); !ok || !up.Equal(at(10)) {
		t.Errorf("first scale-out hook at %v", up)
	}
	if i := lastPeak([]float64{0.5, 1, 4, 4, 2}); i != 3 {
		t.Errorf("last peak stage %d, want 3", i)
	}
	var samples []ScaleSample
	for i, w := range []int{0, 20, 0, 0, 0, 0, 0, 4, 4, 5, 5, 6, 6} { // a blip, then a queue
		samples = append(samples, ScaleSample{Time: at(i), Ring: 2, Waiting: w})
	}
	if over, ok := firstOver(samples, 2); !ok || !over.Equal(at(11)) {
		t.Errorf("queue over 2 a node over 5 s at %v, want 11 s (not the blip at 1 s)", over)
	}
}

// TestScaleOutFromTheRamp: the scale-out check's clock starts when the queue passes its set
// point from the ramp's second stage on; a burst of full rate-limit buckets in the first
// seconds, which the controller lets pass, does not start it.
func TestScaleOutFromTheRamp(t *testing.T) {
	at := func(s int) time.Time { return time.Unix(int64(s), 0) }
	rep := &AutoscaleReport{
		Started:  at(0),
		Config:   Autoscale{Ramp: []float64{0.5, 1, 2}, Stage: 30 * time.Second, SetPoint: 0.5, ScaleOutWithin: 30 * time.Second},
		Requests: []LoadRecord{{Tenant: "web", Start: at(0), End: at(1), Kind: "ok"}},
		Tenants:  map[string]*Tenant{},
		Events:   []ScaleEvent{{Time: at(52), Kind: "hook", Current: 1, Desired: 2}},
	}
	for i := range 60 {
		w := 0
		if i < 3 || i >= 45 { // the opening burst; the ramp's load from 45 s
			w = 4
		}
		rep.Samples = append(rep.Samples, ScaleSample{Time: at(i), Ring: 1, Waiting: w})
	}
	rep.check()
	i := slices.IndexFunc(rep.Checks, func(c Check) bool { return c.Name == "scale-out" })
	if i < 0 || !rep.Checks[i].Pass || !strings.Contains(rep.Checks[i].Detail, "at 45s") {
		t.Errorf("scale-out check: %+v", rep.Checks)
	}
}

// TestRecovery: the recovery time is the first second whose trailing 10 s of interactive
// first tokens have a p99 under the target; batch requests do not count.
func TestRecovery(t *testing.T) {
	start := time.Unix(1000, 0)
	rep := &AutoscaleReport{Target: 100 * time.Millisecond}
	for s := range 40 {
		ttft := 50 * time.Millisecond
		if s < 20 {
			ttft = time.Second // slow until second 20
		}
		for k := range 3 {
			rep.Requests = append(rep.Requests, LoadRecord{Tenant: "web", Kind: "ok", Start: start.Add(time.Duration(s)*time.Second + time.Duration(k)*100*time.Millisecond), TTFT: ttft},
				LoadRecord{Tenant: "bulk", Kind: "ok", Start: start.Add(time.Duration(s) * time.Second), TTFT: time.Minute})
		}
	}
	back, ok := rep.underTarget(start, start.Add(40*time.Second))
	if !ok || !back.Equal(start.Add(30*time.Second)) {
		t.Errorf("under the target from %v (%v), want 30 s in: the window holds slow ones until then", back.Sub(start), ok)
	}
}

// TestBatchCheckChance: the batch check holds the p99 beside batch work to its target and
// says when the two alone phases alone differ by more than the bound.
func TestBatchCheckChance(t *testing.T) {
	const chance = "chance's as much as"
	for _, tc := range []struct {
		alone, again, beside time.Duration
		pass, noted          bool
	}{
		{200 * time.Millisecond, 220 * time.Millisecond, 280 * time.Millisecond, true, false},
		{200 * time.Millisecond, 220 * time.Millisecond, 320 * time.Millisecond, false, false},
		{200 * time.Millisecond, 420 * time.Millisecond, 320 * time.Millisecond, false, true},
		{400 * time.Millisecond, 200 * time.Millisecond, 300 * time.Millisecond, true, true},
	} {
		rep := &AutoscaleReport{Alone: [2]time.Duration{0, tc.alone}, AloneAgain: [2]time.Duration{0, tc.again},
			WithBatch: [2]time.Duration{0, tc.beside}, BatchDone: 10, Target: time.Duration(1.5 * float64(tc.alone))}
		rep.Config.TTFTFactor = 1.5
		c := rep.batchCheck()
		if c.Pass != tc.pass || strings.Contains(c.Detail, chance) != tc.noted {
			t.Errorf("alone %v, again %v, beside %v: pass %v, detail %q; want pass %v, noted %v", tc.alone, tc.again, tc.beside, c.Pass, c.Detail, tc.pass, tc.noted)
		}
	}
}

package testbed

import (
	"fmt"
	"slices"
	"time"

	"github.com/infernode/infernode/internal/measure"
)

// Gray checks how a cluster meets a gray failure: one node made slow (a cpu, delay or
// slowlink fault on Node) until a heal.
type Gray struct {
	Node int
	// Detect bounds the time from the fault until a healthy node's view marks the slow
	// node degraded; Restore the time from the heal until none does.
	Detect, Restore time.Duration
	// TTFTRatio bounds the p99 time to first token of answers served by the healthy nodes
	// while the node is slow, against the same before the fault (the run's own baseline).
	TTFTRatio float64
}

// GrayReport is what a gray-failure scenario measured.
type GrayReport struct {
	Node     string        `json:"node"`
	Detected time.Duration `json:"detected_ns"` // -1: never
	Restored time.Duration `json:"restored_ns"` // -1: never
	// TTFT p99 of answers served by healthy nodes before the fault and while it lasted,
	// and how many answers each holds.
	BaselineP99 time.Duration `json:"baseline_ttft_p99_ns"`
	SlowP99     time.Duration `json:"slow_ttft_p99_ns"`
	BaselineN   int           `json:"baseline_answers"`
	SlowN       int           `json:"slow_answers"`
	// SlowServed is how many answers the slow node served before the fault and while it
	// lasted, against the healthy nodes' (its share should fall).
	SlowServed [2]int `json:"slow_served"`
	HealthyN   [2]int `json:"healthy_served"`
}

// checkGray measures detection, restoration and the healthy nodes' time to first token
// around the scenario's gray failure.
func (c *Cluster) checkGray(rep *Report, s Scenario) {
	g := s.Gray
	slow := c.Nodes[g.Node].ID
	var from, to time.Time
	for _, a := range rep.Faults {
		switch k := a.Fault.Kind; {
		case from.IsZero() && a.Fault.Node == g.Node && (k == "cpu" || k == "delay" || k == "slowlink"):
			from = a.Time
		case !from.IsZero() && to.IsZero() && k == "heal":
			to = a.Time
		}
	}
	gr := &GrayReport{Node: slow, Detected: -1, Restored: -1}
	rep.Gray = gr
	if from.IsZero() || to.IsZero() {
		rep.Checks = append(rep.Checks, Check{Name: "the slow node is marked degraded, and restored", Detail: "no slow-node fault and heal applied"})
		return
	}
	var lastMarked time.Time
	for _, r := range rep.Rings {
		if r.Node == slow || !slices.Contains(r.Degraded, slow) {
			continue
		}
		if r.Time.After(from) && gr.Detected < 0 {
			gr.Detected = r.Time.Sub(from)
		}
		lastMarked = r.Time
	}
	end := rep.Rings[len(rep.Rings)-1].Time
	switch {
	case gr.Detected < 0:
	case lastMarked.Before(to):
		gr.Restored = 0
	case end.Sub(lastMarked) > time.Second: // unmarked on every later sample of a healthy node
		gr.Restored = lastMarked.Sub(to)
	}
	rep.Checks = append(rep.Checks,
		Check{Name: fmt.Sprintf("the slow node is marked degraded within %v", g.Detect), Pass: gr.Detected >= 0 && gr.Detected <= g.Detect,
			Detail: fmt.Sprintf("%s marked degraded %v after the fault (-1ns: never)", slow, gr.Detected.Round(time.Millisecond))},
		Check{Name: fmt.Sprintf("and restored within %v of its recovery", g.Restore), Pass: gr.Restored >= 0 && gr.Restored <= g.Restore,
			Detail: fmt.Sprintf("last marked %v after the heal (-1ns: still marked at the end)", gr.Restored.Round(time.Millisecond))})

	// Streamed answers only: a whole answer's first token comes with its last.
	var before, during []time.Duration
	for _, r := range rep.Records {
		if r.Kind != "ok" || r.Served == "" || !r.Stream {
			continue
		}
		phase := -1
		switch {
		case r.Start.Before(from):
			phase = 0
		case r.Start.After(from) && r.End.Before(to):
			phase = 1
		default:
			continue
		}
		if r.Served == slow {
			gr.SlowServed[phase]++
			continue
		}
		gr.HealthyN[phase]++
		if r.Entry == slow {
			continue // entered through the slow node: its own slowness, not the owner's
		}
		if phase == 0 {
			before = append(before, r.TTFT)
		} else {
			during = append(during, r.TTFT)
		}
	}
	gr.BaselineN, gr.SlowN = len(before), len(during)
	gr.BaselineP99, gr.SlowP99 = measure.Percentile(before, 99), measure.Percentile(during, 99)
	ok := len(before) >= minTTFTAnswers && len(during) >= minTTFTAnswers && float64(gr.SlowP99) <= g.TTFTRatio*float64(gr.BaselineP99)
	if g.TTFTRatio == 0 {
		return
	}
	rep.Checks = append(rep.Checks, Check{Name: fmt.Sprintf("answers served by healthy nodes keep their p99 time to first token within %.1fx", g.TTFTRatio),
		Pass: ok, Detail: fmt.Sprintf("p99 %v over %d streamed answers before the fault, %v over %d while %s was slow (entered elsewhere); %s served %d then %d answers, the others %d then %d",
			gr.BaselineP99.Round(time.Millisecond), len(before), gr.SlowP99.Round(time.Millisecond), len(during), slow,
			slow, gr.SlowServed[0], gr.SlowServed[1], gr.HealthyN[0], gr.HealthyN[1])})
}

// minTTFTAnswers is the fewest answers a phase needs for its TTFT p99 to count: while the
// slow node is not yet degraded, clients wait on it and send little elsewhere.
const minTTFTAnswers = 5

// checkSteady: a slow network is not a broken one: no ring lost a member at any time.
func checkSteady(rep *Report, nodes int) {
	var bad []string
	for _, r := range rep.Rings {
		if r.Size < nodes {
			bad = append(bad, fmt.Sprintf("%s's ring held %d at %s", r.Node, r.Size, r.Time.Format("15:04:05.000")))
		}
	}
	rep.Checks = append(rep.Checks, Check{Name: "no ring loses a member to a slow network", Pass: len(bad) == 0,
		Detail: fmt.Sprintf("%d ring samples, %d short: %v", len(rep.Rings), len(bad), firstN(bad, 5))})
}

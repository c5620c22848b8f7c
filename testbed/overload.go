package testbed

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/infernode/infernode/internal/measure"
)

// Overload is a burst beyond a cluster's capacity. The scenario's workload is the burst;
// Baseline runs first on the same cluster, with just enough clients to keep every sequence
// busy, and measures what the cluster completes when it is not overloaded.
type Overload struct {
	Baseline Workload
	// MinGoodput is the least share of the baseline's completed tokens per second that
	// the cluster must keep completing under the burst.
	MinGoodput float64
}

// OverloadReport is what an overload scenario measured.
type OverloadReport struct {
	Capacity       float64       `json:"capacity_tokens_per_s"` // completed tokens/s of the baseline
	BaselineFailed int           `json:"baseline_failed"`
	Goodput        float64       `json:"goodput_tokens_per_s"` // completed tokens/s under the burst
	Refused        int           `json:"refused"`
	RefusalP99     time.Duration `json:"refusal_p99_ns"` // from sending a request to its refusal
	// What the nodes' counters moved by during each phase, over all nodes: where the
	// machine's time went when goodput differs.
	BaselineWork Work `json:"baseline_work"`
	BurstWork    Work `json:"burst_work"`
}

// Work is what every node's counters moved by during a phase.
type Work struct {
	Generated float64 `json:"generated_tokens"`
	Prefilled float64 `json:"prefilled_tokens"` // prompt tokens not served from a cache
	CPU       float64 `json:"cpu_seconds"`
}

// counters reads the work counters of every running node, summed.
func (c *Cluster) counters() (Work, error) {
	var w Work
	for _, n := range c.running() {
		gen, err1 := c.Metric(n, "infernode_generated_tokens_total")
		prompt, err2 := c.Metric(n, "infernode_prompt_tokens_total")
		reused, err3 := c.Metric(n, "infernode_reused_prefix_tokens_total")
		cpu, err4 := c.Metric(n, "process_cpu_seconds_total")
		if err := errors.Join(err1, err2, err3, err4); err != nil {
			return w, err
		}
		w.Generated, w.Prefilled, w.CPU = w.Generated+gen, w.Prefilled+prompt-reused, w.CPU+cpu
	}
	return w, nil
}

func (w Work) since(before Work) Work {
	return Work{Generated: w.Generated - before.Generated, Prefilled: w.Prefilled - before.Prefilled, CPU: w.CPU - before.CPU}
}

// measureWork runs phase and returns what the nodes did meanwhile.
func (c *Cluster) measureWork(phase func()) (Work, error) {
	before, err := c.counters()
	if err != nil {
		return Work{}, err
	}
	phase()
	after, err := c.counters()
	return after.since(before), err
}

// calibrate runs the baseline workload and measures the cluster's unloaded capacity.
func (c *Cluster) calibrate(ctx context.Context, o Overload) (*OverloadReport, error) {
	var recs []Record
	work, err := c.measureWork(func() { recs = c.RunWorkload(ctx, o.Baseline, c.serving) })
	rate, failed := goodput(recs, o.Baseline.Duration)
	return &OverloadReport{Capacity: rate, BaselineFailed: failed, BaselineWork: work}, err
}

// goodput is the rate answers completed tokens over the window of a workload's duration
// from its first request, and how many requests failed. Each answer's tokens count evenly
// over the time it was generating (from its first token, when streamed), and only the part
// inside the window: the drain after a workload stops starting requests, which is
// different after a baseline and after a burst, does not count.
func goodput(recs []Record, window time.Duration) (float64, int) {
	var from time.Time
	for _, r := range recs {
		if from.IsZero() || r.Start.Before(from) {
			from = r.Start
		}
	}
	to := from.Add(window)
	tokens, failed := 0.0, 0
	for _, r := range recs {
		if r.Kind != "ok" {
			failed++
			continue
		}
		start := r.Start
		if r.Stream {
			start = start.Add(r.TTFT)
		}
		span := r.End.Sub(start)
		end := r.End
		if end.After(to) {
			end = to
		}
		inside := end.Sub(start) // start is never before from
		switch {
		case span <= 0:
			if !r.End.After(to) {
				tokens += float64(r.Tokens)
			}
		case inside > 0:
			tokens += float64(r.Tokens) * inside.Seconds() / span.Seconds()
		}
	}
	return tokens / window.Seconds(), failed
}

// checkOverload: busy is not dead (every ring kept every node throughout), every refusal
// was a 503 with Retry-After, and the cluster kept completing work at nearly its unloaded
// rate.
func checkOverload(rep *Report, s Scenario) {
	o := rep.Overload
	o.Goodput, _ = goodput(rep.Records, s.Workload.Duration)
	var refusals []time.Duration
	var bad []string
	for _, r := range rep.Records {
		if r.Kind == "ok" {
			continue
		}
		refusals = append(refusals, r.End.Sub(r.Start))
		if r.Status != 503 || !r.Retry {
			bad = append(bad, fmt.Sprintf("conv %d turn %d via %s: %s %d %s", r.Conv, r.Turn, r.Entry, r.Kind, r.Status, r.Error))
		}
	}
	o.Refused, o.RefusalP99 = len(refusals), measure.Percentile(refusals, 99)
	var shrunk []string
	for _, rs := range rep.Rings {
		if rs.Size != s.Nodes {
			shrunk = append(shrunk, fmt.Sprintf("%s held %d at %s", rs.Node, rs.Size, rs.Time.Format("15:04:05.000")))
		}
	}
	share := o.Goodput / max(o.Capacity, 1e-9)
	rep.Checks = append(rep.Checks,
		Check{Name: "busy is not dead: no ring change under overload", Pass: len(shrunk) == 0 && len(rep.Rings) > 0,
			Detail: fmt.Sprintf("%d ring samples, %d without every node: %v", len(rep.Rings), len(shrunk), firstN(shrunk, 5))},
		Check{Name: "every refusal is a 503 with Retry-After", Pass: len(bad) == 0,
			Detail: fmt.Sprintf("%d refused (p99 %v to the refusal), %d otherwise: %v", len(refusals), o.RefusalP99.Round(time.Millisecond), len(bad), firstN(bad, 5))},
		Check{Name: "goodput under the burst keeps up with the unloaded capacity", Pass: share >= s.Overload.MinGoodput && o.BaselineFailed == 0,
			Detail: fmt.Sprintf("%.0f tokens/s under the burst, %.0f unloaded (%.0f%%, minimum %.0f%%); %d baseline requests failed",
				o.Goodput, o.Capacity, 100*share, 100*s.Overload.MinGoodput, o.BaselineFailed)})
}

package testbed

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"text/tabwriter"
	"time"
)

// The report of a chaos run: its checks, faults and rings over time, as JSON, a timeline
// picture and a table.

// Check is one invariant's verdict.
type Check struct {
	Name   string `json:"name"`
	Pass   bool   `json:"pass"`
	Detail string `json:"detail"`
}

// Report is a scenario's outcome.
type Report struct {
	Scenario    string          `json:"scenario"`
	Doc         string          `json:"doc"`
	Nodes       int             `json:"nodes"`
	Seed        uint64          `json:"seed"`
	MaxTokens   int             `json:"max_tokens"`
	Started     time.Time       `json:"started"`
	Took        time.Duration   `json:"took_ns"`
	Faults      []Applied       `json:"faults"`
	Sent        int             `json:"sent"`
	Completed   int             `json:"completed"`
	Resumed     int             `json:"resumed"`
	Failed      int             `json:"failed"`
	Hung        int             `json:"hung"`
	Compared    int             `json:"compared_with_reference"`
	NearTies    int             `json:"near_ties"`
	Detections  int             `json:"detections_checked"`
	Affinity    int             `json:"affinity_checked"`
	AffinityBad int             `json:"affinity_violations"`
	Moved       map[string]int  `json:"moved_by_path"` // conversations each KV path moved (see Cluster.moves)
	Converge    time.Duration   `json:"converge_after_heal_ns"`
	Windows     []Window        `json:"windows"`
	Rings       []RingSample    `json:"rings"`
	Checks      []Check         `json:"checks"`
	Overload    *OverloadReport `json:"overload,omitempty"`
	Gray        *GrayReport     `json:"gray,omitempty"`
	Records     []Record        `json:"records"`
}

// Window is a span in which a node was faulted: from the fault until its healing was seen
// by every ring (or the end of the run).
type Window struct {
	Node string    `json:"node"`
	Kind string    `json:"kind"`
	From time.Time `json:"from"`
	To   time.Time `json:"to"`
}

// Passed reports whether every invariant held.
func (r *Report) Passed() bool {
	for _, c := range r.Checks {
		if !c.Pass {
			return false
		}
	}
	return true
}

// errString is err's text, or "" for nil.
func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// Save writes the report as JSON and its timeline as a PNG into dir.
func (r *Report) Save(dir string) error {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "report.json"), b, 0o644); err != nil {
		return err
	}
	return r.Plot(filepath.Join(dir, "timeline.png"))
}

// Summary writes the report as a readable table.
func (r *Report) Summary(w io.Writer) {
	verdict := "PASS"
	if !r.Passed() {
		verdict = "FAIL"
	}
	fmt.Fprintf(w, "scenario %s (%d nodes, seed %d): %s in %v\n", r.Scenario, r.Nodes, r.Seed, verdict, r.Took.Round(time.Millisecond))
	fmt.Fprintf(w, "  requests: %d sent, %d completed, %d resumed, %d failed, %d hung; %d answers compared with the reference (%d at near-ties); %d detections and %d conversations' affinity checked (%d moved); rings converged %v after the last heal\n",
		r.Sent, r.Completed, r.Resumed, r.Failed, r.Hung, r.Compared, r.NearTies, r.Detections, r.Affinity, r.AffinityBad, r.Converge.Round(time.Millisecond))
	if o := r.Overload; o != nil {
		fmt.Fprintf(w, "  overload: goodput %.0f tokens/s under the burst, %.0f unloaded (%.0f%%); %d refused, p99 time to a refusal %v\n",
			o.Goodput, o.Capacity, 100*o.Goodput/max(o.Capacity, 1e-9), o.Refused, o.RefusalP99.Round(time.Millisecond))
		for _, p := range []struct {
			name string
			w    Work
		}{{"baseline", o.BaselineWork}, {"burst", o.BurstWork}} {
			fmt.Fprintf(w, "  %s: nodes generated %.0f tokens and prefilled %.0f on %.1f CPU-seconds (%.1f ms a generated token)\n",
				p.name, p.w.Generated, p.w.Prefilled, p.w.CPU, 1000*p.w.CPU/max(p.w.Generated, 1))
		}
	}
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
	for _, a := range r.Faults {
		det := "-"
		if a.Detection > 0 {
			det = a.Detection.Round(time.Millisecond).String()
		}
		note := a.Aim + a.Err + a.DetectErr
		if a.Unsupported != "" {
			note = "not applied: " + a.Unsupported
		}
		fmt.Fprintf(tw, "  fault\t%s\tbackend %s\trings agreed after %s\t%s\n", a.Fault, a.Backend, det, note)
	}
	for _, ch := range r.Checks {
		mark := "pass"
		if !ch.Pass {
			mark = "FAIL"
		}
		fmt.Fprintf(tw, "  %s\t%s\t%s\n", mark, ch.Name, ch.Detail)
	}
	tw.Flush()
}

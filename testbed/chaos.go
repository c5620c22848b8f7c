package testbed

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"sort"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/infernode/infernode/netem"
)

// Fault is one scheduled action on the cluster.
type Fault struct {
	At     time.Duration `json:"at"`
	Kind   string        `json:"kind"` // kill, restart, pause, resume, leave, join, isolate, halves, oneway, loss, bandwidth, delay, heal
	Node   int           `json:"node"` // index into the cluster's nodes (join: ignored)
	Peer   int           `json:"peer,omitempty"`
	Amount int           `json:"amount,omitempty"` // loss percent, bandwidth kbit, delay ms
}

func (f Fault) String() string {
	s := fmt.Sprintf("%v %s node%d", f.At, f.Kind, f.Node+1)
	if f.Kind == "oneway" {
		s += fmt.Sprintf("->node%d", f.Peer+1)
	}
	if f.Amount != 0 {
		s += fmt.Sprintf(" %d", f.Amount)
	}
	return s
}

// Scenario is a cluster, a workload and a fault schedule.
type Scenario struct {
	Name     string
	Doc      string
	Nodes    int
	Netns    bool // needs network namespaces (root)
	Workload Workload
	Faults   []Fault
}

// Applied is a fault as it happened.
type Applied struct {
	Fault   Fault     `json:"fault"`
	Time    time.Time `json:"time"`
	Backend string    `json:"backend"` // signal, nftables, tbf, netem, process
	Err     string    `json:"error,omitempty"`
	// Detection is how long until every other running node's ring agreed with the fault
	// (kill, pause, isolate) or its healing (restart, resume, heal, join); 0 if not measured.
	Detection time.Duration `json:"detection_ns,omitempty"`
	// Note says why Detection was not measured (for example, the next fault changed the
	// membership before the rings agreed).
	Note string `json:"note,omitempty"`
}

// Check is one invariant's verdict.
type Check struct {
	Name   string `json:"name"`
	Pass   bool   `json:"pass"`
	Detail string `json:"detail"`
}

// Report is a scenario's outcome.
type Report struct {
	Scenario    string        `json:"scenario"`
	Doc         string        `json:"doc"`
	Nodes       int           `json:"nodes"`
	Seed        uint64        `json:"seed"`
	MaxTokens   int           `json:"max_tokens"`
	Started     time.Time     `json:"started"`
	Took        time.Duration `json:"took_ns"`
	Faults      []Applied     `json:"faults"`
	Sent        int           `json:"sent"`
	Completed   int           `json:"completed"`
	Resumed     int           `json:"resumed"`
	FailedOK    int           `json:"failed_explicitly"`
	Hung        int           `json:"hung"`
	AffinityBad int           `json:"affinity_violations"`
	Converge    time.Duration `json:"converge_after_heal_ns"`
	Checks      []Check       `json:"checks"`
	Records     []Record      `json:"records"`
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

// RunScenario launches a cluster for s, runs its workload beside its faults, checks the
// invariants and returns the report. cfg gives the binary and model; its Nodes and
// Topology are set from the scenario.
func RunScenario(ctx context.Context, cfg Config, s Scenario) (*Report, error) {
	ctx, stop := context.WithCancel(ctx) // ends the last fault's measurement context too
	defer stop()
	rep := &Report{Scenario: s.Name, Doc: s.Doc, Nodes: s.Nodes, Seed: s.Workload.Seed, MaxTokens: s.Workload.MaxTokens, Started: time.Now()}
	cfg.Nodes = s.Nodes
	if s.Netns {
		hosts := s.Nodes + countJoins(s.Faults)
		topo, err := netem.New("infch", hosts)
		if err != nil {
			return nil, err
		}
		defer topo.Close()
		cfg.Topology = topo
	}
	c, err := Start(ctx, cfg)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	if _, err := c.WaitRings(ctx, c.IDs(), 30*time.Second); err != nil {
		return nil, err
	}
	baseline := map[string]nodeUsage{}
	for _, n := range c.Nodes {
		baseline[n.ID] = c.usage(n)
	}

	// Faults run beside the workload; faulty[n] lists when node n was touched.
	var mu sync.Mutex
	faulty := map[string][][2]time.Time{}
	touch := func(n *Node, from, to time.Time) {
		mu.Lock()
		faulty[n.ID] = append(faulty[n.ID], [2]time.Time{from, to})
		mu.Unlock()
	}
	open := map[string]time.Time{}
	start := time.Now()
	faultsDone := make(chan struct{})
	var measures sync.WaitGroup
	go func() {
		defer close(faultsDone)
		supersede := func() {}
		for _, f := range s.Faults {
			select {
			case <-ctx.Done():
				return
			case <-time.After(time.Until(start.Add(f.At))):
			}
			supersede() // a new fault changes what the rings should agree on
			mctx, cancel := context.WithCancel(ctx)
			supersede = cancel
			a, measure := c.apply(mctx, f)
			mu.Lock()
			i := len(rep.Faults)
			rep.Faults = append(rep.Faults, a)
			mu.Unlock()
			if measure != nil {
				measures.Go(func() {
					d, err := measure()
					mu.Lock()
					switch {
					case err == nil:
						rep.Faults[i].Detection = d
					case mctx.Err() != nil && ctx.Err() == nil:
						rep.Faults[i].Note = fmt.Sprintf("superseded by the next fault after %v", d.Round(time.Millisecond))
					default:
						rep.Faults[i].Err = "rings did not agree: " + err.Error()
					}
					mu.Unlock()
				})
			}
			if f.Node < len(c.Nodes) {
				n := c.Nodes[f.Node]
				switch f.Kind {
				case "kill", "pause", "leave", "isolate", "halves", "oneway", "loss", "bandwidth", "delay":
					if _, ok := open[n.ID]; !ok {
						open[n.ID] = a.Time
					}
					if f.Kind == "oneway" && f.Peer < len(c.Nodes) {
						open[c.Nodes[f.Peer].ID] = a.Time
					}
					if f.Kind == "halves" {
						for _, o := range c.Nodes {
							if _, ok := open[o.ID]; !ok {
								open[o.ID] = a.Time
							}
						}
					}
				}
			}
		}
		// The last fault's measurement runs to its end; measures.Wait below waits for it.
	}()
	alive := func() []*Node {
		var out []*Node
		for _, n := range c.Nodes {
			if n.Running() {
				out = append(out, n)
			}
		}
		return out
	}
	rep.Records = c.RunWorkload(ctx, s.Workload, alive)
	<-faultsDone
	measures.Wait()
	end := time.Now()
	for id, from := range open {
		for _, n := range c.Nodes {
			if n.ID == id {
				touch(n, from, end)
			}
		}
	}

	// After the last heal: every running node's ring holds every running node.
	var ids []string
	for _, n := range alive() {
		ids = append(ids, n.ID)
	}
	conv, err := c.WaitRings(ctx, ids, 30*time.Second)
	rep.Converge = conv
	rep.Checks = append(rep.Checks, Check{Name: "rings converge after the last heal", Pass: err == nil,
		Detail: fmt.Sprintf("every ring holds %v after %v (%v)", ids, conv.Round(time.Millisecond), errText(err))})

	c.checkRecords(rep, faulty)
	c.checkIdle(ctx, rep, baseline, alive())
	c.checkSeams(ctx, rep, alive())
	rep.Took = time.Since(rep.Started)
	return rep, nil
}

func countJoins(fs []Fault) int {
	n := 0
	for _, f := range fs {
		if f.Kind == "join" {
			n++
		}
	}
	return n
}

func errText(err error) string {
	if err == nil {
		return "ok"
	}
	return err.Error()
}

// apply carries out one fault. It returns at once (so the schedule keeps time) with a
// function that measures how long the other nodes' rings take to agree with the fault.
func (c *Cluster) apply(ctx context.Context, f Fault) (Applied, func() (time.Duration, error)) {
	a := Applied{Fault: f, Time: time.Now(), Backend: "signal"}
	if f.Kind == "join" {
		a.Backend = "process"
		_, err := c.Add(ctx, fmt.Sprintf("node%d", len(c.Nodes)+1))
		if err != nil {
			a.Err = err.Error()
			return a, nil
		}
		a.Fault.Node = len(c.Nodes) - 1
		want := c.runningIDs()
		return a, func() (time.Duration, error) { return c.WaitRings(ctx, want, 30*time.Second) }
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
	case "leave":
		a.Backend = "signal (SIGTERM)"
		err, expectWithout = n.Stop(40*time.Second), true
	case "isolate", "halves", "oneway", "loss", "bandwidth", "delay", "heal":
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
			a.Backend, err = "netem", n.Host.Delay(f.Amount, f.Amount/5)
		case "heal":
			err = errors.Join(err, c.cfg.Topology.HealAll())
			expectAll = true
		}
	default:
		err = fmt.Errorf("unknown fault %q", f.Kind)
	}
	a.Err = errString(err)
	if err != nil {
		return a, nil
	}
	switch {
	case expectWithout:
		var others []*Node
		for _, o := range c.Nodes {
			if o != n && o.Running() {
				others = append(others, o)
			}
		}
		want := c.IDs(others...)
		return a, func() (time.Duration, error) { return c.WaitRings(ctx, want, 30*time.Second, n) }
	case expectAll:
		want := c.runningIDs()
		return a, func() (time.Duration, error) { return c.WaitRings(ctx, want, 30*time.Second) }
	}
	return a, nil
}

// errString is err's text, or "" for nil.
func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
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

// checkRecords: nothing hung, every failure explicit, affinity held for untouched owners,
// at most one hop.
func (c *Cluster) checkRecords(rep *Report, faulty map[string][][2]time.Time) {
	touched := func(id string, from, to time.Time) bool {
		for _, iv := range faulty[id] {
			if from.Before(iv[1]) && to.After(iv[0]) {
				return true
			}
		}
		return false
	}
	var silent []string
	for _, r := range rep.Records {
		rep.Sent++
		switch r.Kind {
		case "ok":
			rep.Completed++
			if r.Resumed {
				rep.Resumed++
			}
		case "hung":
			rep.Hung++
		case "http_error", "sse_error":
			rep.FailedOK++
		default: // conn_error, cut: explicit only if the entry node itself was faulted
			if touched(r.Entry, r.Start, r.End.Add(time.Second)) {
				rep.FailedOK++
			} else {
				silent = append(silent, fmt.Sprintf("conv %d turn %d via %s: %s %s", r.Conv, r.Turn, r.Entry, r.Kind, r.Error))
			}
		}
	}
	rep.Checks = append(rep.Checks,
		Check{Name: "no request hangs", Pass: rep.Hung == 0, Detail: fmt.Sprintf("%d of %d requests outlived the deadline", rep.Hung, rep.Sent)},
		Check{Name: "every failure is explicit", Pass: len(silent) == 0, Detail: fmt.Sprintf("%d failed explicitly; silent: %v", rep.FailedOK, firstN(silent, 5))})

	// Affinity: turns of a conversation whose serving node no fault touched during the
	// run stay on one node.
	byConv := map[int][]Record{}
	for _, r := range rep.Records {
		if r.Kind == "ok" {
			byConv[r.Conv] = append(byConv[r.Conv], r)
		}
	}
	var bad []string
	checked := 0
	for conv, rs := range byConv {
		if len(rs) < 2 {
			continue
		}
		first, last := rs[0].Start, rs[len(rs)-1].End
		exempt := false
		for _, r := range rs {
			if r.Resumed || touched(r.Served, first, last) {
				exempt = true
			}
		}
		// Any fault anywhere moves ring partitions between the remaining members too;
		// only conversations that ran while no node at all was faulted are held to it.
		for id := range faulty {
			if touched(id, first, last) {
				exempt = true
			}
		}
		if exempt {
			continue
		}
		checked++
		for _, r := range rs[1:] {
			if r.Served != rs[0].Served {
				bad = append(bad, fmt.Sprintf("conv %d: %s then %s", conv, rs[0].Served, r.Served))
				break
			}
		}
	}
	rep.AffinityBad = len(bad)
	rep.Checks = append(rep.Checks, Check{Name: "conversations untouched by faults keep their owner", Pass: len(bad) == 0,
		Detail: fmt.Sprintf("%d conversations checked, %d moved: %v", checked, len(bad), firstN(bad, 5))})

	var internal, resumes float64
	for _, n := range c.Nodes {
		if n.Running() {
			v, _ := c.Metric(n, `infernode_http_requests_total{endpoint="/internal/v1/generate"`)
			internal += v
			r, _ := c.Metric(n, "infernode_resumes_total")
			resumes += r
		}
	}
	rep.Checks = append(rep.Checks, Check{Name: "at most one hop", Pass: internal <= float64(rep.Sent)+resumes,
		Detail: fmt.Sprintf("%.0f forwarded requests served for %d client requests and %.0f resumes (a forwarded request is never forwarded again)", internal, rep.Sent, resumes)})
}

func firstN(s []string, n int) []string {
	sort.Strings(s)
	return s[:min(n, len(s))]
}

type nodeUsage struct{ goroutines, rss float64 }

func (c *Cluster) usage(n *Node) nodeUsage {
	g, _ := c.Metric(n, "go_goroutines")
	r, _ := c.Metric(n, "process_resident_memory_bytes")
	return nodeUsage{g, r}
}

// checkIdle: survivors go back to no running sequences and bounded goroutines and memory.
func (c *Cluster) checkIdle(ctx context.Context, rep *Report, baseline map[string]nodeUsage, nodes []*Node) {
	var problems []string
	for _, n := range nodes {
		deadline := time.Now().Add(10 * time.Second)
		for {
			run, err1 := c.Metric(n, "infernode_running_sequences")
			wait, err2 := c.Metric(n, "infernode_waiting_requests")
			if err1 == nil && err2 == nil && run == 0 && wait == 0 {
				break
			}
			if time.Now().After(deadline) {
				problems = append(problems, fmt.Sprintf("%s: %v running, %v waiting 10s after the load", n.ID, run, wait))
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
		b, ok := baseline[n.ID]
		u := c.usage(n)
		if ok && b.goroutines > 0 && (u.goroutines > b.goroutines+50 || u.rss > 2*b.rss+200<<20) {
			problems = append(problems, fmt.Sprintf("%s: goroutines %v (baseline %v), RSS %.0f MB (baseline %.0f MB)",
				n.ID, u.goroutines, b.goroutines, u.rss/1e6, b.rss/1e6))
		}
	}
	rep.Checks = append(rep.Checks, Check{Name: "survivors return to idle, nothing leaks", Pass: len(problems) == 0,
		Detail: fmt.Sprintf("%d nodes checked; %v", len(nodes), problems)})
}

// checkSeams: a resumed greedy answer matches the uninterrupted answer to the same turn
// through every seam, so nothing was lost or repeated where it moved. After the last seam
// the continuation was decoded from a re-prefilled prompt; on a random-weight model a
// near-tie can then go the other way, so a difference there is reported, not failed.
func (c *Cluster) checkSeams(ctx context.Context, rep *Report, nodes []*Node) {
	checked, identical, later := 0, 0, 0
	var bad []string
	for _, r := range rep.Records {
		if !r.Resumed || r.Kind != "ok" || len(nodes) == 0 || !r.Stream {
			continue
		}
		ref := request(ctx, &http.Client{Timeout: time.Minute}, nodes[0], r.Messages, rep.MaxTokens, false, time.Minute)
		if ref.Kind != "ok" {
			continue
		}
		checked++
		d := 0
		for d < min(len(r.Text), len(ref.Text)) && r.Text[d] == ref.Text[d] {
			d++
		}
		seam := slices.Max(r.Seams)
		switch {
		case r.Text == ref.Text:
			identical++
		case d > seam:
			later++
		default:
			bad = append(bad, fmt.Sprintf("conv %d turn %d: differs at byte %d, seam at %d: resumed %q, reference %q",
				r.Conv, r.Turn, d, seam, around(r.Text, d), around(ref.Text, d)))
		}
	}
	rep.Checks = append(rep.Checks, Check{Name: "resumed answers read as one answer", Pass: len(bad) == 0,
		Detail: fmt.Sprintf("%d resumed streams compared with an uninterrupted rerun: %d identical, %d diverge after the seam, %d broken at it %v",
			checked, identical, later, len(bad), firstN(bad, 3))})
}

func around(s string, i int) string {
	return s[max(0, i-30):min(len(s), i+30)]
}

// Summary writes the report as a readable table.
func (r *Report) Summary(w io.Writer) {
	verdict := "PASS"
	if !r.Passed() {
		verdict = "FAIL"
	}
	fmt.Fprintf(w, "scenario %s (%d nodes, seed %d): %s in %v\n", r.Scenario, r.Nodes, r.Seed, verdict, r.Took.Round(time.Millisecond))
	fmt.Fprintf(w, "  requests: %d sent, %d completed, %d resumed, %d failed explicitly, %d hung; affinity violations %d; rings converged %v after the last heal\n",
		r.Sent, r.Completed, r.Resumed, r.FailedOK, r.Hung, r.AffinityBad, r.Converge.Round(time.Millisecond))
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
	for _, a := range r.Faults {
		det := "-"
		if a.Detection > 0 {
			det = a.Detection.Round(time.Millisecond).String()
		}
		fmt.Fprintf(tw, "  fault\t%s\tbackend %s\trings agreed after %s\t%s%s\n", a.Fault, a.Backend, det, a.Note, a.Err)
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

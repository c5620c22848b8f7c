package testbed

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/infernode/infernode/netem"
)

// A chaos scenario: a cluster, a workload and a schedule of faults run together
// (RunScenario); the faults are in faults.go, the invariants checked afterwards in
// invariants.go against the reference answers of reference.go, the report in report.go.

// Scenario is a cluster, a workload, a fault schedule and what the run must show.
type Scenario struct {
	Name     string
	Doc      string
	Nodes    int
	Netns    bool // needs network namespaces (root)
	Workload Workload
	Faults   []Fault
	// MaxFailures is the most failed requests the scenario tolerates, each of them
	// explained (entered on a faulted node, or a 503 with Retry-After).
	MaxFailures int
	// MinResumes is the fewest answers that must have moved to another owner mid-stream.
	MinResumes int
	// MinAffinity is the fewest conversations the affinity check must cover.
	MinAffinity int
	// NoResumes: the faults are graceful (a leave, a join, overload), so no answer may
	// have moved mid-stream.
	NoResumes bool
	// Args are extra flags for every node of this scenario.
	Args []string
	// Overload, when set, makes the workload a burst beyond the cluster's capacity and
	// adds its invariants (see overload.go).
	Overload *Overload
	// Steady: the faults slow the network down without breaking it, so no ring may lose
	// a member at any time.
	Steady bool
	// Gray, when set, checks how the cluster meets one slow node (see gray.go).
	Gray *Gray
	// Chatter, if set, runs beside Workload (its First should keep its conversations
	// apart from Workload's): many open conversations of short turns, so that many straddle each
	// fault while Workload's long answers are what the faults cut.
	Chatter *Workload
	// MinMoved is the fewest conversations each KV path (replica, handoff, push, pull)
	// must move in a run (see Cluster.moves).
	MinMoved map[string]int
}

// RunScenario launches a cluster for s, runs its workload beside its faults, checks the
// invariants and returns the report. cfg gives the binary and model; its Nodes and
// Topology are set from the scenario. Every completed answer is compared with the answer
// a quiet standalone node gives to the same conversation and turn (greedy decoding is
// deterministic), so cfg.Model should be a real model whose text is worth comparing.
func RunScenario(ctx context.Context, cfg Config, s Scenario) (*Report, error) {
	ctx, stop := context.WithCancel(ctx)
	defer stop()
	if err := s.check(); err != nil {
		return nil, err
	}
	rep := &Report{Scenario: s.Name, Doc: s.Doc, Nodes: s.Nodes, Seed: s.Workload.Seed, MaxTokens: s.Workload.MaxTokens, Started: time.Now()}
	cfg.Nodes = s.Nodes
	cfg.Args = append(slices.Clone(cfg.Args), s.Args...)
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
	if s.Overload != nil {
		if rep.Overload, err = c.calibrate(ctx, *s.Overload); err != nil {
			return nil, err
		}
	}
	baseline := c.baselines(ctx, c.Nodes...)

	start := time.Now()
	faultsDone := make(chan struct{})
	var mu sync.Mutex // guards rep.Faults and baseline while faults run
	var measures sync.WaitGroup
	go func() {
		defer close(faultsDone)
		last := -1 // the node the last Busiest fault chose
		for _, f := range s.Faults {
			select {
			case <-ctx.Done():
				return
			case <-time.After(time.Until(start.Add(f.At))):
			}
			aim := ""
			if f.Node == Busiest {
				f.Node, aim = c.busiest(ctx, f.Kind, last)
				last = f.Node
			}
			a, measure := c.apply(ctx, f)
			a.Aim = aim
			mu.Lock()
			i := len(rep.Faults)
			rep.Faults = append(rep.Faults, a)
			mu.Unlock()
			if measure == nil {
				continue
			}
			measures.Go(func() {
				_, err := measure()
				mu.Lock()
				defer mu.Unlock()
				// From the moment the fault began to be applied: a heal or restart takes a
				// while to carry out, and the rings may agree before it has finished.
				rep.Faults[i].Detection = time.Since(a.Time)
				if err != nil {
					rep.Faults[i].DetectErr = err.Error()
				}
				if k := rep.Faults[i].Fault.Kind; err == nil && (k == "restart" || k == "join" || k == "upgrade") {
					n := c.Nodes[rep.Faults[i].Fault.Node]
					baseline[n.ID] = c.baselines(ctx, n)[n.ID] // a new process: a new baseline
				}
			})
		}
	}()
	sampling := make(chan struct{})
	var sampled sync.WaitGroup
	sampled.Go(func() { rep.Rings = c.sampleRings(ctx, sampling) })
	c.flight = &flight{byNode: map[string]int{}}
	workload := func() {
		var chatter []Record
		var wg sync.WaitGroup
		if s.Chatter != nil {
			wg.Go(func() { chatter = c.RunWorkload(ctx, *s.Chatter, c.serving) })
		}
		rep.Records = c.RunWorkload(ctx, s.Workload, c.serving)
		wg.Wait()
		rep.Records = append(rep.Records, chatter...)
	}
	if rep.Overload == nil {
		workload()
	} else if rep.Overload.BurstWork, err = c.measureWork(workload); err != nil {
		return nil, err
	}
	<-faultsDone
	measures.Wait()
	close(sampling)
	sampled.Wait()
	end := time.Now()

	// After the last heal: every running node's ring holds every running node (but those
	// told to leave, which may still be draining).
	ids := c.stayingIDs()
	conv, err := c.WaitRings(ctx, ids, 30*time.Second)
	rep.Converge = conv
	rep.Checks = append(rep.Checks, Check{Name: "rings converge after the last heal", Pass: err == nil,
		Detail: fmt.Sprintf("every ring holds %v after %v (%v)", ids, conv.Round(time.Millisecond), errText(err))})

	rep.Windows = windows(rep.Faults, c, end)
	c.checkDetection(rep)
	c.checkRecords(rep, s)
	c.checkAffinity(rep, s)
	c.checkWarm(rep, s)
	c.checkUpgraded(rep)
	if s.Overload != nil {
		checkOverload(rep, s)
	}
	if s.Steady {
		checkSteady(rep, s.Nodes)
	}
	if s.Gray != nil {
		c.checkGray(rep, s)
	}
	c.checkIdle(ctx, rep, baseline, c.running())
	c.checkAnswers(ctx, rep, cfg)
	rep.Took = time.Since(rep.Started)
	return rep, nil
}

// check refuses a schedule that heals a node before its fault's detection bound has
// passed: the healing would end the measurement early, and a detector that never noticed
// the fault would pass.
func (s Scenario) check() error {
	for i, f := range s.Faults {
		switch f.Kind {
		case "kill", "pause", "isolate", "leave":
		default:
			continue
		}
		for _, g := range s.Faults[i+1:] {
			if g.Node == f.Node && g.At-f.At < detectBound(f) {
				return fmt.Errorf("scenario %s: %s comes %v after %s, before its detection bound of %v", s.Name, g, g.At-f.At, f, detectBound(f))
			}
		}
	}
	return nil
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

// sampleRings records every running node's ring size four times a second until stop.
func (c *Cluster) sampleRings(ctx context.Context, stop <-chan struct{}) []RingSample {
	var out []RingSample
	tick := time.NewTicker(250 * time.Millisecond)
	defer tick.Stop()
	for {
		for _, n := range c.running() {
			v, err := c.View(n)
			if err != nil || len(v.Members) == 0 {
				continue
			}
			rs := RingSample{Node: n.ID, Time: time.Now(), Running: v.Members[0].Load["running"], Waiting: v.Members[0].Load["waiting"]}
			for _, m := range v.Members {
				if m.OnRing && m.Compatible {
					rs.Size++
				}
				if m.Degraded {
					rs.Degraded = append(rs.Degraded, m.ID)
				}
			}
			out = append(out, rs)
		}
		select {
		case <-stop:
			return out
		case <-ctx.Done():
			return out
		case <-tick.C:
		}
	}
}

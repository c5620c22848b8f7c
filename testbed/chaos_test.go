package testbed

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/infernode/infernode/internal/testenv"
	"github.com/infernode/infernode/netem"
)

// TestChaosShort runs the short scenario suite with real processes; every invariant must
// hold. Namespace scenarios are skipped, with the reason, where namespaces are unavailable.
func TestChaosShort(t *testing.T) {
	// A real model: every answer is compared with a reference, and text that means
	// something makes a difference worth reading.
	model := testenv.SharedModel(t, "stories260K.gguf")
	seed := uint64(time.Now().UnixNano())
	if v := os.Getenv("INFERNODE_CHAOS_SEED"); v != "" {
		var err error
		if seed, err = strconv.ParseUint(v, 10, 64); err != nil {
			t.Fatalf("INFERNODE_CHAOS_SEED: %v", err)
		}
	}
	t.Logf("seed %d (replay: INFERNODE_CHAOS_SEED=%[1]d gives the same entry nodes and request kinds)", seed)
	nsErr := netem.Available()
	for _, s := range ShortSuite(seed) {
		t.Run(s.Name, func(t *testing.T) {
			if s.Netns && nsErr != nil {
				testenv.Require(t, false, fmt.Sprintf("needs network namespaces (root): %v", nsErr))
			}
			logs := t.TempDir()
			if out := os.Getenv("INFERNODE_CHAOS_OUT"); out != "" {
				logs = filepath.Join(out, s.Name)
				if err := os.MkdirAll(logs, 0o755); err != nil {
					t.Fatal(err)
				}
			}
			cfg := Config{Binary: binary, Model: model, LogDir: logs, Engine: strings.Fields(os.Getenv("INFERNODE_CHAOS_ENGINE")),
				Args: []string{"--ctx", "8192", "--threads", "1", "--log-level", "info"}}
			runChecked(t, cfg, s)
		})
	}
}

// runChecked runs scenario s on cfg, logs and saves its report, and fails t for every
// invariant that failed and every fault that could not be applied.
func runChecked(t *testing.T, cfg Config, s Scenario) {
	rep, err := RunScenario(t.Context(), cfg, s)
	if err != nil {
		t.Fatal(err)
	}
	var sb strings.Builder
	rep.Summary(&sb)
	t.Log("\n" + sb.String())
	if err := rep.Save(cfg.LogDir); err != nil {
		t.Errorf("save the report: %v", err)
	}
	if rep.Sent == 0 || rep.Completed == 0 {
		t.Errorf("the workload sent %d and completed %d requests", rep.Sent, rep.Completed)
	}
	for _, ch := range rep.Checks {
		if !ch.Pass {
			t.Errorf("invariant %q failed: %s", ch.Name, ch.Detail)
		}
	}
	for _, a := range rep.Faults {
		if a.Err != "" {
			t.Errorf("fault %s: %s", a.Fault, a.Err)
		}
	}
}

// TestSchedules: every scenario leaves each fault's detection bound before healing it.
func TestSchedules(t *testing.T) {
	for _, s := range append(ShortSuite(1), LongSuite(1)...) {
		if err := s.check(); err != nil {
			t.Error(err)
		}
	}
	bad := Scenario{Name: "hasty", Faults: []Fault{{At: time.Second, Kind: "kill", Node: 1}, {At: 2 * time.Second, Kind: "restart", Node: 1}}}
	if bad.check() == nil {
		t.Error("a restart 1s after a kill passed the schedule check")
	}
}

// TestTieAt: the oracle accepts a difference only where the reference's own choice had a
// nearly as likely alternative that the answer took, measured from the token chosen.
func TestTieAt(t *testing.T) {
	tok := func(token string, logprob float64, alts ...any) refToken {
		rt := refToken{Token: token, Logprob: logprob}
		for i := 0; i < len(alts); i += 2 {
			rt.TopLogprobs = append(rt.TopLogprobs, struct {
				Token   string  `json:"token"`
				Logprob float64 `json:"logprob"`
			}{alts[i].(string), alts[i+1].(float64)})
		}
		return rt
	}
	ref := refAnswer{text: "Miabbelied. Then", tokens: []refToken{
		tok("Miabbeli", -0.1, "Miabbeli", -0.1, "Tim", -3.0),
		// An exact tie, the chosen token listed second.
		tok("ed", -1.46, "ve", -1.46, "ed", -1.46, "ck", -1.64),
		tok(". Then", -0.5, ". Then", -0.5, ". As", -2.5),
	}}
	for _, c := range []struct {
		text  string
		bound float64
		tie   bool
	}{
		{"Miabbelive. As", nearTie, true},  // the other half of the exact tie
		{"Miabbelick", nearTie, true},      // 0.18 below the choice
		{"Miabbelied. As", nearTie, false}, // 2.0 below the choice
		{"Miabbelixx", nearTie, false},     // never an alternative
		{"Tom", nearTie, false},            // at byte 0, not an alternative either
		{"Miabbelive. As", seamTie, true},  // an exact tie just after a seam
		{"Miabbelick", seamTie, false},     // 0.18 is far too much there
	} {
		d := 0
		for d < min(len(c.text), len(ref.text)) && c.text[d] == ref.text[d] {
			d++
		}
		gap, proof := ref.tieAt(c.text, d, c.bound)
		if (proof == "") != c.tie {
			t.Errorf("%q (differs at %d): near-tie %v (gap %.3g, %s), want %v", c.text, d, proof == "", gap, proof, c.tie)
		}
	}
}

// TestAffinityAroundDegraded: a member marked degraded unsettles only the conversations
// it served; one that moved between two other nodes at that moment is still caught.
func TestAffinityAroundDegraded(t *testing.T) {
	t0 := time.Now()
	at := func(s float64) time.Time { return t0.Add(time.Duration(s * float64(time.Second))) }
	turns := func(conv int, served ...string) []Record {
		var rs []Record
		for i, id := range served {
			rs = append(rs, Record{Conv: conv, Turn: i, Kind: "ok", Served: id, Start: at(4 + float64(i)), End: at(4.5 + float64(i))})
		}
		return rs
	}
	rep := &Report{Started: t0,
		// node1 marks node2 degraded at 5s; its conversations may move from 4s to 7s.
		Rings: []RingSample{{Node: "node1", Time: at(3)}, {Node: "node1", Time: at(5), Degraded: []string{"node2"}}}}
	for _, rs := range [][]Record{
		turns(1, "node2", "node3"), // handed on: not checked
		turns(2, "node1", "node1"), // kept: checked
		turns(3, "node3", "node3"), // kept: checked
		turns(4, "node3", "node2"), // taken back: not checked
	} {
		rep.Records = append(rep.Records, rs...)
	}
	var c Cluster
	c.checkAffinity(rep, Scenario{MinAffinity: 2})
	if ch := rep.Checks[len(rep.Checks)-1]; !ch.Pass || rep.Affinity != 2 {
		t.Errorf("conversations of the degraded member only: %d checked, %+v; want 2, pass", rep.Affinity, ch)
	}

	rep.Checks, rep.Affinity = nil, 0
	rep.Records = append(rep.Records, turns(5, "node1", "node3")...) // moved between two others
	c.checkAffinity(rep, Scenario{MinAffinity: 2})
	if ch := rep.Checks[len(rep.Checks)-1]; ch.Pass || rep.AffinityBad != 1 {
		t.Errorf("conv 5 moved from node1 to node3 while node2 was marked: %d bad, %+v; want 1, fail", rep.AffinityBad, ch)
	}

	// A slow link between node2 and node3 over the same time: in a scenario that holds every
	// ring whole (Steady) it leaves node1's conversations checked; otherwise none.
	rep.Windows = []Window{{Node: "node2", Kind: "slowlink", From: at(3.5), To: at(6)}, {Node: "node3", Kind: "slowlink", From: at(3.5), To: at(6)}}
	for _, steady := range []bool{true, false} {
		rep.Checks, rep.Affinity, rep.AffinityBad = nil, 0, 0
		c.checkAffinity(rep, Scenario{Steady: steady})
		if want := map[bool]int{true: 2, false: 0}[steady]; rep.Affinity != want { // conv 2 and conv 5
			t.Errorf("slow link, steady %v: %d conversations checked, want %d", steady, rep.Affinity, want)
		}
	}
}

// TestAffinityAroundIsolated: a conversation whose turn entered at a node cut off from the
// others, while it was, moves to it by design (it serves on its own ring) and is not
// checked; one that kept away from it still is.
func TestAffinityAroundIsolated(t *testing.T) {
	t0 := time.Now()
	at := func(s float64) time.Time { return t0.Add(time.Duration(s * float64(time.Second))) }
	rep := &Report{Started: t0, Windows: []Window{{Node: "node2", Kind: "isolate", From: at(1), To: at(8)}}, Records: []Record{
		{Conv: 9, Turn: 0, Kind: "ok", Entry: "node1", Served: "node3", Start: at(5), End: at(5.3)},
		{Conv: 9, Turn: 1, Kind: "ok", Entry: "node2", Served: "node2", Start: at(5.5), End: at(6)}, // the partition-heal CI failure
		{Conv: 10, Turn: 0, Kind: "ok", Entry: "node1", Served: "node3", Start: at(5), End: at(5.3)},
		{Conv: 10, Turn: 1, Kind: "ok", Entry: "node3", Served: "node3", Start: at(5.5), End: at(6)},
	}}
	var c Cluster
	c.checkAffinity(rep, Scenario{MinAffinity: 1})
	if ch := rep.Checks[len(rep.Checks)-1]; !ch.Pass || rep.Affinity != 1 {
		t.Errorf("%d conversations checked, %+v; want 1 (conv 10), pass", rep.Affinity, ch)
	}
}

// TestMutantsApply: every mutant of make chaos-mutants (testbed/mutants) still applies to
// this tree, so the suite's proof that it catches each broken KV path does not rot.
func TestMutantsApply(t *testing.T) {
	patches, err := filepath.Glob("mutants/*.patch")
	if err != nil || len(patches) == 0 {
		t.Fatalf("no mutants: %v", err)
	}
	if err := exec.Command("git", "-C", "..", "rev-parse", "--git-dir").Run(); err != nil {
		testenv.Require(t, false, fmt.Sprintf("needs git and a checkout: %v", err))
	}
	for _, p := range patches {
		abs, _ := filepath.Abs(p)
		if out, err := exec.Command("git", "-C", "..", "apply", "--check", abs).CombinedOutput(); err != nil {
			t.Errorf("%s no longer applies: %v\n%s", p, err, out)
		}
	}
}

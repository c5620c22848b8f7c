package testbed

import (
	"fmt"
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
	t.Logf("seed %d (replay: the same seed gives the same entry nodes and request kinds)", seed)
	nsErr := netem.Available()
	for _, s := range ShortSuite(seed) {
		t.Run(s.Name, func(t *testing.T) {
			if s.Netns && nsErr != nil {
				testenv.Require(t, false, fmt.Sprintf("needs network namespaces (root): %v", nsErr))
			}
			cfg := Config{Binary: binary, Model: model, LogDir: t.TempDir(),
				Args: []string{"--ctx", "8192", "--threads", "1", "--log-level", "info"}}
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
		})
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

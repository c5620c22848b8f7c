package testbed

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/infernode/infernode/internal/testenv"
)

// TestUpgrade is make upgrade-check: a cluster on an earlier binary (INFERNODE_UPGRADE_FROM)
// replaced node by node with this one under chat load. Every answer completes, none
// resumes (each leave is graceful), every answer equals this binary's own, and every
// follow-up after the last replacement is warm.
func TestUpgrade(t *testing.T) {
	from := os.Getenv("INFERNODE_UPGRADE_FROM")
	if from == "" {
		t.Skip("INFERNODE_UPGRADE_FROM names no earlier binary (make upgrade-check builds one)")
	}
	model := testenv.SharedModel(t, "stories260K.gguf")
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d; from %s", seed, from)
	logs := t.TempDir()
	if out := os.Getenv("INFERNODE_CHAOS_OUT"); out != "" {
		logs = filepath.Join(out, "upgrade")
	}
	cfg := Config{Binary: from, Upgrade: binary, Model: model, LogDir: logs,
		Args: []string{"--ctx", "8192", "--threads", "1", "--log-level", "info"}}
	rep, err := RunScenario(t.Context(), cfg, Upgrade(seed, 3))
	if err != nil {
		t.Fatal(err)
	}
	var sb strings.Builder
	rep.Summary(&sb)
	t.Log("\n" + sb.String())
	if err := rep.Save(cfg.LogDir); err != nil {
		t.Errorf("save the report: %v", err)
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

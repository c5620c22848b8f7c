package testbed

import (
	"os"
	"path/filepath"
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
	runChecked(t, cfg, Upgrade(seed, 3))
}

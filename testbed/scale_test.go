package testbed

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/infernode/infernode/internal/poll"
	"github.com/infernode/infernode/internal/testenv"
)

// TestScaleHook: under a load that keeps requests waiting, every node's controller wants
// more nodes (infernode_desired_nodes), and exactly one node (the owner of the
// autoscaling key) runs the scale hook, with the current and desired counts.
func TestScaleHook(t *testing.T) {
	dir := t.TempDir()
	hook := fmt.Sprintf(`echo "$INFERNODE_CURRENT_NODES $INFERNODE_DESIRED_NODES" >> %s/hook-$PPID`, dir)
	c := launch(t, Config{Model: testenv.Model(t), Nodes: 2, Args: []string{"--ctx", "8192", "--sequences", "1",
		"--scale-hook", hook, "--scale-queue", "1", "--scale-up-cooldown", "1s", "--scale-max", "4"}})
	if _, err := c.WaitRings(t.Context(), c.IDs(), 30*time.Second); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for i := range 8 { // one sequence a node: most of these wait
		wg.Go(func() {
			for k := 0; ; k++ {
				select {
				case <-stop:
					return
				default:
				}
				chat(t, c.Nodes[i%2].URL(), []message{{"user", fmt.Sprintf("tell me story %d-%d", i, k)}}, 64)
			}
		})
	}
	fired := func() []string {
		files, _ := filepath.Glob(filepath.Join(dir, "hook-*"))
		return files
	}
	poll.Until(t, 60*time.Second, "the scale hook to run", func() bool { return len(fired()) > 0 })
	poll.Until(t, 30*time.Second, "every node to want more nodes", func() bool {
		for _, n := range c.Nodes {
			if v, err := c.Metric(n, "infernode_desired_nodes"); err != nil || v <= 2 {
				return false
			}
		}
		return true
	})
	close(stop)
	wg.Wait()
	files := fired()
	b, _ := os.ReadFile(files[0])
	var current, desired int
	fmt.Sscan(strings.Fields(string(b))[0], &current)
	fmt.Sscan(strings.Fields(string(b))[1], &desired)
	if len(files) != 1 || current != 2 || desired <= 2 || desired > 4 {
		t.Errorf("hook runs %v: %q; want one node's, from 2 to 3 or 4", files, b)
	}
	t.Logf("the hook ran: %s", strings.TrimSpace(string(b)))
}

package testbed

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/infernode/infernode/internal/testenv"
)

// chromium is the path of a Chromium to drive, or "".
func chromium() string {
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if path, err := exec.LookPath(name); err == nil {
			return path
		}
	}
	return ""
}

// TestDashboard loads GET / of a running cluster that requires an API key in headless
// Chromium: the page asks for the key, then lists every member up, draws the ring with
// an arc for each, and shows the event feed; when a node is killed, its row turns down
// and the feed says so. INFERNODE_SCREENSHOT=path keeps a screenshot (docs/dashboard.png
// is one).
func TestDashboard(t *testing.T) {
	browser := chromium()
	testenv.Require(t, browser != "", "Chromium is not installed (make test installs Debian's chromium)")
	const key = "dashboard-test-key"
	c := launch(t, Config{Model: testenv.Model(t), Nodes: 3, APIKey: key})
	if _, err := c.WaitRings(t.Context(), c.IDs(), 30*time.Second); err != nil {
		t.Fatal(err)
	}

	opts := append(chromedp.DefaultExecAllocatorOptions[:], chromedp.ExecPath(browser), chromedp.NoSandbox,
		chromedp.UserDataDir(t.TempDir()), chromedp.WindowSize(1440, 820),
		// This machine has no network beyond loopback: no background fetches.
		chromedp.Flag("disable-quic", true), chromedp.Flag("disable-component-update", true))
	alloc, cancelAlloc := chromedp.NewExecAllocator(t.Context(), opts...)
	defer cancelAlloc()
	ctx, cancelTab := chromedp.NewContext(alloc)
	defer cancelTab()
	ctx, cancel := context.WithTimeout(ctx, 90*time.Second)
	defer cancel()

	entry := c.Nodes[0]
	state := func(id string) string {
		return fmt.Sprintf(`(document.querySelector('tr[data-member="%s"]') || {dataset: {}}).dataset.state`, id)
	}
	type void = chromedp.Void
	eval := func(expr string) int {
		n, err := chromedp.Run(ctx, chromedp.Evaluate[int](expr))
		if err != nil {
			t.Fatalf("%s: %v", expr, err)
		}
		return n
	}
	err := chromedp.Do(ctx,
		chromedp.Navigate(entry.URL()+"/"),
		chromedp.WaitVisible(chromedp.CSS("#keyform")),
		chromedp.SendKeys(chromedp.CSS("#key"), key),
		chromedp.Click(chromedp.CSS("#keyform button")),
		chromedp.Poll[void](fmt.Sprintf("%s === 'up' && %s === 'up' && %s === 'up'", state("node1"), state("node2"), state("node3")),
			chromedp.WithPollingTimeout(30*time.Second)),
		chromedp.Poll[void](`document.querySelectorAll('#events li').length > 0`, chromedp.WithPollingTimeout(10*time.Second)),
	)
	if err != nil {
		t.Fatalf("the dashboard never listed the three nodes up with events: %v", err)
	}
	arcs := eval(`document.querySelectorAll('#ring path').length`)
	owners := eval(`new Set([...document.querySelectorAll('#ring path')].map(p => p.dataset.owner)).size`)
	if owners != 3 || arcs < 3 {
		t.Errorf("the ring is drawn with %d arcs of %d owners, want arcs of all 3 nodes", arcs, owners)
	}

	// Some traffic, so the table has load to show.
	for i := range 6 {
		body := fmt.Sprintf(`{"messages":[{"role":"user","content":"dashboard question %d"}],"max_tokens":8}`, i)
		if status := postChat(t, c.Nodes[i%3].URL(), key, body); status != 200 {
			t.Fatalf("chat with the key: %d", status)
		}
	}
	victim := c.Nodes[2]
	victim.Kill()
	killed := time.Now()
	err = chromedp.Do(ctx, chromedp.Poll[void](fmt.Sprintf("['dead', 'down'].includes(%s)", state(victim.ID)),
		chromedp.WithPollingTimeout(30*time.Second)))
	if err != nil {
		t.Fatalf("the killed node's row never turned down: %v", err)
	}
	t.Logf("the dashboard showed %s down %v after the kill", victim.ID, time.Since(killed).Round(time.Millisecond))
	err = chromedp.Do(ctx, chromedp.Poll[void](fmt.Sprintf(
		`[...document.querySelectorAll('#events li')].some(li => ['down', 'dead'].includes(li.dataset.kind) && li.textContent.includes('%s'))`,
		victim.ID), chromedp.WithPollingTimeout(15*time.Second)))
	if err != nil {
		t.Fatalf("the event feed never said %s went down: %v", victim.ID, err)
	}
	if up, err := chromedp.Run(ctx, chromedp.Evaluate[string](state(c.Nodes[1].ID))); err != nil || up != "up" {
		t.Errorf("%s shows %q (%v) after another node died, want up", c.Nodes[1].ID, up, err)
	}
	shot, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
	if err != nil {
		t.Fatal(err)
	}
	path := os.Getenv("INFERNODE_SCREENSHOT")
	if path == "" {
		path = filepath.Join(t.TempDir(), "dashboard.png")
	}
	if err := os.WriteFile(path, shot, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("%d events shown; screenshot %s (%d bytes)", eval(`document.querySelectorAll('#events li').length`), path, len(shot))
}

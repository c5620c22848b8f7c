// Package poll waits for a condition in tests: it checks it every few milliseconds until
// it holds or a deadline passes, so tests synchronise on observable state, not on sleeps.
package poll

import (
	"testing"
	"time"
)

// Until fails t when cond has not held within timeout. what names the condition in the
// failure.
func Until(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// Package poll waits for a condition: it checks it every few milliseconds until it holds
// or a deadline passes, so tests (and simulations) synchronise on observable state, not on
// sleeps.
package poll

import (
	"net/http"
	"testing"
	"time"
)

// Until fails t when cond has not held within timeout. what names the condition in the
// failure.
func Until(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	if !Within(timeout, 5*time.Millisecond, cond) {
		t.Fatalf("timed out after %v waiting for %s", timeout, what)
	}
}

// Within checks cond every interval until it holds (true) or timeout passes (false).
func Within(timeout, every time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(every)
	}
	return true
}

// Answers200 reports whether GET url answered 200 within timeout, asking every 200 ms (a
// server starting up, for the benchmark commands).
func Answers200(url string, timeout time.Duration) bool {
	client := &http.Client{Timeout: time.Second}
	return Within(timeout, 200*time.Millisecond, func() bool {
		resp, err := client.Get(url)
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
}

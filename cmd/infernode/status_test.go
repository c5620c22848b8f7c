package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/infernode/infernode/internal/poll"
	"github.com/infernode/infernode/node/routing"
)

// lockedBuffer is a bytes.Buffer safe for one writer and concurrent readers.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// status --watch redraws the table in place with every refresh, keeps watching through a
// node that does not answer, and stops when its context ends.
func TestStatusWatch(t *testing.T) {
	var calls atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := calls.Add(1)
		if n == 2 {
			http.Error(w, "restarting", http.StatusServiceUnavailable)
			return
		}
		json.NewEncoder(w).Encode(routing.View{Self: "a", Members: []routing.MemberView{
			{ID: "a", State: "alive", Model: "stories260K", OnRing: true, RingShare: 1, TokensPerS: int(n)}}})
	}))
	defer srv.Close()
	ctx, cancel := context.WithCancel(t.Context())
	var out, errs lockedBuffer
	done := make(chan int)
	go func() { done <- status(ctx, []string{"--addr", srv.URL, "--watch", "--interval", "10ms"}, &out, &errs) }()
	poll.Until(t, 10*time.Second, "three tables after the failed refresh", func() bool { return calls.Load() >= 5 })
	cancel()
	if code := <-done; code != 0 {
		t.Fatalf("status --watch exited %d: %s", code, errs.String())
	}
	got := out.String()
	frames := strings.Split(got, "\x1b[H")
	if len(frames) < 5 {
		t.Fatalf("%d redraws, want at least 5:\n%q", len(frames)-1, got)
	}
	if !strings.Contains(got, "answered 503") {
		t.Errorf("the failed refresh is not shown:\n%q", got)
	}
	for _, n := range []int{1, 3, 4} {
		if !strings.Contains(got, fmt.Sprintf("stories260K  100.0%%  0        0        0        %d", n)) {
			t.Errorf("no table from refresh %d:\n%s", n, got)
		}
	}
}

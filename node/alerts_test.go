package node

import (
	"context"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/infernode/infernode/session/infer"
)

// slowEngine is the fake engine with a delay before every answer.
type slowEngine struct {
	fakeEngine
	delay atomic.Int64 // nanoseconds
}

func (e *slowEngine) Submit(ctx context.Context, req infer.Request) (infer.Stream, error) {
	time.Sleep(time.Duration(e.delay.Load()))
	return e.fakeEngine.Submit(ctx, req)
}

// TestLatencyAlert: first tokens that turn much slower than this node's own past raise
// one alert (counted, with the z-score as a gauge), not one per slow request.
func TestLatencyAlert(t *testing.T) {
	engine := &slowEngine{fakeEngine: fakeEngine{n: 1}}
	engine.delay.Store(int64(10 * time.Millisecond))
	url, _ := startStandalone(t, engine, func(c *Config) {
		// A high threshold: this machine's timing noise must not alert, a slowdown of 20x must.
		c.Anomaly.Bucket, c.Anomaly.Window, c.Anomaly.MinBuckets, c.Anomaly.MinCount, c.Anomaly.Threshold = 30*time.Millisecond, 20, 5, 1, 10
	})
	ask := func(d time.Duration) {
		for end := time.Now().Add(d); time.Now().Before(end); {
			resp := postJSON(t, url+"/v1/completions", `{"prompt":"hi","max_tokens":1}`)
			resp.Body.Close()
		}
	}
	metric := func(name string) string {
		resp, err := http.Get(url + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return grepLines(string(b), name)
	}
	ask(400 * time.Millisecond) // calibrating
	if m := metric(`infernode_anomaly_alerts_total{series="ttft"}`); !strings.HasSuffix(m, " 0") {
		t.Fatalf("a steady node alerted: %s", m)
	}
	engine.delay.Store(int64(200 * time.Millisecond)) // twenty times slower
	ask(700 * time.Millisecond)
	if m := metric(`infernode_anomaly_alerts_total{series="ttft"}`); !strings.HasSuffix(m, " 1") {
		t.Errorf("a slowdown: %s, want one alert", m)
	}
	if m := metric(`infernode_latency_zscore{series="ttft"}`); m == "" {
		t.Error("no z-score gauge")
	}
}

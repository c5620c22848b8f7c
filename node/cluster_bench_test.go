package node

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/infernode/infernode/gossip"
	"github.com/infernode/infernode/session"
)

// fakeEngine answers every request at once with n tokens: routing benchmarks measure the
// cluster, not inference.
type fakeEngine struct{ n int }

func (f fakeEngine) Submit(ctx context.Context, req session.Request) (Stream, error) {
	return &fakeStream{n: f.n}, nil
}
func (fakeEngine) ChatPrompt(msgs []session.Message) (string, error) {
	var b strings.Builder
	for _, m := range msgs {
		b.WriteString(m.Content)
	}
	return b.String(), nil
}
func (fakeEngine) Stats() session.Stats { return session.Stats{} }
func (fakeEngine) Ready() bool          { return true }

type fakeStream struct{ n, i int }

func (s *fakeStream) Recv() (string, error) {
	if s.i < s.n {
		s.i++
		return " tok", nil
	}
	return "", io.EOF
}
func (s *fakeStream) Result() session.Result {
	return session.Result{FinishReason: "length", PromptTokens: 1, CompletionTokens: s.n}
}
func (s *fakeStream) Admitted() (int, int, bool) { return 1, 0, true }
func (s *fakeStream) Tokens() int                { return s.i }

type benchNode struct {
	url     string
	cluster *Cluster
}

// startFakeCluster runs n in-process nodes (real gossip, real HTTP on loopback) with fake
// engines until the benchmark ends.
func startFakeCluster(b testing.TB, n int, secret string) []benchNode {
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	ctx, cancel := context.WithCancel(context.Background())
	b.Cleanup(cancel)
	var nodes []benchNode
	var seed string
	for i := range n {
		id := fmt.Sprintf("n%d", i+1)
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			b.Fatal(err)
		}
		gc := gossip.DefaultConfig()
		gc.ID, gc.BindAddr, gc.BindPort, gc.Logger = id, "127.0.0.1", 0, log
		if seed != "" {
			gc.Join = []string{seed}
		}
		g, err := gossip.New(gc, gossip.Meta{ID: id, HTTPAddr: ln.Addr().String(), Fingerprint: "fake"})
		if err != nil {
			b.Fatal(err)
		}
		cc := DefaultClusterConfig()
		cc.Self, cc.HTTPAddr, cc.Fingerprint, cc.Logger, cc.Secret = id, ln.Addr().String(), "fake", log, secret
		cl, err := NewCluster(cc, g, fakeEngine{n: 1})
		if err != nil {
			b.Fatal(err)
		}
		nc := DefaultConfig()
		nc.ID, nc.ModelName, nc.Listener, nc.Logger, nc.MaxStreams = id, "fake", ln, log, 4096
		srv, err := New(nc, fakeEngine{n: 1}, cl)
		if err != nil {
			b.Fatal(err)
		}
		go g.Run(ctx)
		go cl.Run(ctx)
		go srv.Run(ctx)
		for g.Addr() == "" {
			time.Sleep(time.Millisecond)
		}
		if seed == "" {
			seed = g.Addr()
		}
		nodes = append(nodes, benchNode{url: "http://" + ln.Addr().String(), cluster: cl})
	}
	deadline := time.Now().Add(20 * time.Second)
	for _, nd := range nodes {
		for len(nd.cluster.View().Members) != n || !allOnRing(nd.cluster.View()) {
			if time.Now().After(deadline) {
				b.Fatalf("fake cluster did not converge: %+v", nd.cluster.View())
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	return nodes
}

func allOnRing(v View) bool {
	for _, m := range v.Members {
		if !m.OnRing {
			return false
		}
	}
	return true
}

// ownedBy returns session ids whose owner is node id.
func ownedBy(c *Cluster, id string, n int) []string {
	var keys []string
	for i := 0; len(keys) < n; i++ {
		k := fmt.Sprint("conv-", i)
		if cands := c.candidates(k); len(cands) > 0 && cands[0].id == id {
			keys = append(keys, k)
		}
	}
	return keys
}

const benchBody = `{"prompt":"hello","max_tokens":1}`

func timedPost(b testing.TB, client *http.Client, url, key string) time.Duration {
	req, _ := http.NewRequest("POST", url+"/v1/completions", strings.NewReader(benchBody))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Session-ID", key)
	start := time.Now()
	resp, err := client.Do(req)
	if err != nil {
		b.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		b.Fatalf("status %d", resp.StatusCode)
	}
	return time.Since(start)
}

func percentile(d []time.Duration, p float64) float64 {
	s := slices.Clone(d)
	slices.Sort(s)
	return float64(s[min(len(s)-1, int(float64(len(s))*p))].Microseconds()) / 1000
}

// BenchmarkHop compares requests sent straight to their owner with the same requests
// entering on another node (one forwarding hop), with fake engines.
func BenchmarkHop(b *testing.B) {
	nodes := startFakeCluster(b, 2, "")
	keys := ownedBy(nodes[0].cluster, "n2", 64)
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 8}}
	for _, tc := range []struct {
		name string
		url  string
	}{{"direct", nodes[1].url}, {"forwarded", nodes[0].url}} {
		b.Run(tc.name, func(b *testing.B) {
			var lat []time.Duration
			i := 0
			for b.Loop() {
				lat = append(lat, timedPost(b, client, tc.url, keys[i%len(keys)]))
				i++
			}
			b.ReportMetric(percentile(lat, 0.5), "p50-ms")
			b.ReportMetric(percentile(lat, 0.99), "p99-ms")
		})
	}
}

// BenchmarkRoutingCapacity measures forwarded requests a second through one entry node,
// with fake engines on the owners.
func BenchmarkRoutingCapacity(b *testing.B) {
	nodes := startFakeCluster(b, 3, "")
	keys := append(ownedBy(nodes[0].cluster, "n2", 32), ownedBy(nodes[0].cluster, "n3", 32)...)
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
	b.SetParallelism(8)
	start := time.Now()
	b.RunParallel(func(pb *testing.PB) {
		i := 0
		for pb.Next() {
			timedPost(b, client, nodes[0].url, keys[i%len(keys)])
			i++
		}
	})
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "req/s")
}

// startUnloaded runs a standalone server whose engine has not loaded yet.
func startUnloaded(t testing.TB) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	nc := DefaultConfig()
	nc.ID, nc.ModelName, nc.Listener = "loading", "m", ln
	nc.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	srv, err := New(nc, &LocalEngine{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	go srv.Run(ctx)
	return "http://" + ln.Addr().String()
}

package node

import (
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"
)

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
// entering on another node (one signed forwarding hop), with fake engines.
func BenchmarkHop(b *testing.B) {
	nodes := startFakeCluster(b, 2, testSecret)
	keys := ownedBy(b, nodes[0], "n2", 64)
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
	nodes := startFakeCluster(b, 3, testSecret)
	keys := append(ownedBy(b, nodes[0], "n2", 32), ownedBy(b, nodes[0], "n3", 32)...)
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

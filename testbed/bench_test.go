package testbed

import (
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
	"time"
)

// BenchmarkHopRealEngine compares requests sent to their owner with the same requests
// entering on another node, on real infernode processes and the default model. Each
// request generates one token, so its latency is its time to first token; every
// conversation is new (no cached prefix) and short.
func BenchmarkHopRealEngine(b *testing.B) {
	c := startCluster(b, 2)
	owner, entry := c.Nodes[1], c.Nodes[0]
	var convs [][]message
	for i := 0; len(convs) < 200; i++ {
		m := []message{{"user", fmt.Sprintf("question %d about the river", i)}}
		if chat(b, entry.URL(), m, 1).node == owner.ID {
			convs = append(convs, m)
		}
	}
	for _, tc := range []struct {
		name string
		via  *Node
	}{{"direct", owner}, {"forwarded", entry}} {
		b.Run(tc.name, func(b *testing.B) {
			var lat []time.Duration
			i := 0
			for b.Loop() {
				start := time.Now()
				if a := chat(b, tc.via.URL(), convs[i%len(convs)], 1); a.node != owner.ID {
					b.Fatalf("served by %s", a.node)
				}
				lat = append(lat, time.Since(start))
				i++
			}
			slices.Sort(lat)
			b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1000, "p50-ms")
			b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds())/1000, "p99-ms")
		})
	}
}

// BenchmarkMovedTurn: the time to first token of the next turn of a long conversation
// whose owner left (SIGTERM: its caches are handed off) or died (kill -9: its replicas
// take over), against the same turn of an identical conversation its new owner has never
// seen (cold prefill). Each iteration starts a 3-node cluster. The model is
// INFERNODE_BENCH_MODEL when set (make bench-model), else the test model.
func BenchmarkMovedTurn(b *testing.B) {
	var extra []string
	if m := os.Getenv("INFERNODE_BENCH_MODEL"); m != "" {
		extra = append(extra, "--model", m)
	}
	for _, how := range []string{"leave", "kill"} {
		b.Run(how, func(b *testing.B) {
			var warm, cold []time.Duration
			cached := 0
			for b.Loop() {
				c := startCluster(b, 3, extra...)
				entry, victim := c.Nodes[0], c.Nodes[1]
				var m []message
				for i := 0; m == nil; i++ {
					try := []message{{"system", fmt.Sprintf("story %d: %s", i, strings.Repeat("a long and winding tale of the river and the sea ", 90))}, {"user", "begin"}}
					if chat(b, entry.URL(), try, 1).node == victim.ID {
						m = try
					}
				}
				first := chat(b, entry.URL(), m, 32)
				next := append(m, message{"assistant", first.text}, message{"user", "go on"})
				control := slices.Clone(next)
				control[0].Content = "another " + control[0].Content // the same length, never seen
				settledTransfers(b, c, c.Nodes[0], c.Nodes[2])
				if how == "leave" {
					victim.Stop(30 * time.Second)
				} else {
					victim.Kill()
				}
				if _, err := c.WaitRings(b.Context(), c.IDs(entry, c.Nodes[2]), 10*time.Second, victim); err != nil {
					b.Fatal(err)
				}
				start := time.Now()
				a := chat(b, entry.URL(), next, 1)
				warm = append(warm, time.Since(start))
				cached += a.cached
				start = time.Now()
				chat(b, entry.URL(), control, 1)
				cold = append(cold, time.Since(start))
				c.Close()
			}
			slices.Sort(warm)
			slices.Sort(cold)
			b.ReportMetric(float64(warm[len(warm)/2].Microseconds())/1000, "moved-ttft-ms")
			b.ReportMetric(float64(cold[len(cold)/2].Microseconds())/1000, "cold-ttft-ms")
			b.ReportMetric(float64(cold[len(cold)/2])/float64(warm[len(warm)/2]), "speedup")
			b.ReportMetric(float64(cached)/float64(len(warm)), "cached-tokens")
		})
	}
}

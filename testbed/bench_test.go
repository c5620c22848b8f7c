package testbed

import (
	"fmt"
	"slices"
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

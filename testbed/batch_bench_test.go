package testbed

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/infernode/infernode/internal/measure"
	"github.com/infernode/infernode/internal/testenv"
)

// BenchmarkBatchBeside: what batch work does to an interactive request's first token on
// one real node, on a core of its own and held to the autoscale scenario's CPU quota (20%
// of a CPU in 10 ms periods). Each iteration is one interactive probe (stories260K, a new
// short prompt, 8 tokens, streamed) sent while no other interactive request runs, after
// a random pause: first alone, then as many alone again, then as many beside 8
// closed-loop batch clients (tenant priority=batch, 32 tokens each; the node runs 4
// sequences, as the scenario's). The ratio of the p99s beside and alone is the
// scenario's batch bound (1.5x) without its own interactive load; the ratio of the two
// alone phases' (aa-) is how far chance alone moves it. `make bench-batch-beside` runs
// it held off the node's core:
//
//	taskset -c 1 go test ./testbed -run '^$' -bench BatchBeside -benchtime 300x
func BenchmarkBatchBeside(b *testing.B) {
	model := testenv.SharedModel(b, "stories260K.gguf")
	for _, tc := range []struct {
		name    string
		percent int // of one CPU, in 10 ms periods; 0: no quota
	}{{"own-core", 0}, {"cpu-20pct-10ms", 20}} {
		b.Run(tc.name, func(b *testing.B) {
			keys, limits, err := tenantFiles(b.TempDir())
			if err != nil {
				b.Fatal(err)
			}
			// launch turns host KV off for byte-exact comparisons; the scenario's nodes keep it.
			c := launch(b, Config{Model: model, Nodes: 1, Pin: true, APIKey: "key-of-the-testbed-0001", Args: []string{
				"--sequences", "4", "--ctx", "4096", "--kv-host=true", "--key-file", keys, "--limits", limits}})
			n := c.Nodes[0]
			if err := n.WaitServing(b.Context(), time.Minute); err != nil {
				b.Fatal(err)
			}
			if tc.percent > 0 {
				backend, err := n.LimitCPU(tc.percent, 10*time.Millisecond)
				if err != nil {
					b.Skipf("no CPU quota here: %v", err)
				}
				b.Logf("CPU held by %s", backend)
			}
			web := tenantClient("web")
			rng := rand.New(rand.NewPCG(1, 2))
			probe := func(label string, i int) time.Duration {
				time.Sleep(time.Duration(20+rng.IntN(60)) * time.Millisecond)
				r := loadRequest(b.Context(), web, n, "web", fmt.Sprintf("probe %s %d: the old stone bridge", label, i), "", 8)
				if r.Kind != "ok" {
					b.Fatalf("probe %s %d: %s %d %s", label, i, r.Kind, r.Status, r.Error)
				}
				return r.TTFT
			}
			var alone, again, beside []time.Duration
			for i := 0; b.Loop(); i++ {
				alone = append(alone, probe("alone", i))
			}
			// The same probes alone once more: the two alone phases differ by chance alone,
			// which is how far apart two measurements of one thing fall (an A/A test).
			for i := range alone {
				again = append(again, probe("again", i))
			}
			stop := make(chan struct{})
			stopBatch := sync.OnceFunc(func() { close(stop) })
			b.Cleanup(stopBatch) // a failed probe ends the batch clients too
			answers := make(chan int)
			go func() { answers <- closedLoop(b.Context(), c.Nodes, "bulk", 8, 32, stop) }()
			began := time.Now()
			for i := range alone {
				beside = append(beside, probe("beside", i))
			}
			took := time.Since(began)
			stopBatch()
			answered := <-answers
			ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
			b.ReportMetric(ms(measure.Percentile(alone, 50)), "alone-p50-ms")
			b.ReportMetric(ms(measure.Percentile(alone, 99)), "alone-p99-ms")
			b.ReportMetric(ms(measure.Percentile(beside, 50)), "beside-p50-ms")
			b.ReportMetric(ms(measure.Percentile(beside, 99)), "beside-p99-ms")
			b.ReportMetric(float64(measure.Percentile(beside, 50))/float64(measure.Percentile(alone, 50)), "p50-ratio")
			b.ReportMetric(float64(measure.Percentile(beside, 99))/float64(measure.Percentile(alone, 99)), "p99-ratio")
			b.ReportMetric(float64(measure.Percentile(again, 50))/float64(measure.Percentile(alone, 50)), "aa-p50-ratio")
			b.ReportMetric(float64(measure.Percentile(again, 99))/float64(measure.Percentile(alone, 99)), "aa-p99-ratio")
			b.ReportMetric(float64(answered)/took.Seconds(), "batch-answers/s")
			b.ReportMetric(0, "ns/op")
		})
	}
}

package session

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/infernode/infernode/internal/measure"
)

// benchEngine runs an engine on INFERNODE_BENCH_MODEL (make bench sets it to the
// SmolLM2-135M-shaped model) for the benchmark's duration.
func benchEngine(b *testing.B, edit func(*Config)) *Engine {
	b.Helper()
	path := os.Getenv("INFERNODE_BENCH_MODEL")
	if path == "" {
		b.Skip("INFERNODE_BENCH_MODEL not set; run through make bench")
	}
	cfg := DefaultConfig()
	cfg.ModelPath = path
	cfg.Seed = 1
	cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	if th, err := strconv.Atoi(os.Getenv("INFERNODE_BENCH_THREADS")); err == nil {
		cfg.Threads = th
	}
	if edit != nil {
		edit(&cfg)
	}
	return runEngine(b, cfg)
}

// BenchmarkDecode measures aggregate decode throughput with n sequences generating at once,
// in steady state: text events (one a token, as the readers keep up) that arrive while all
// n requests are decoding, from the last first-token to the first finish, over that
// window's length. cmd/loadgen measures the same way over HTTP.
func BenchmarkDecode(b *testing.B) {
	for _, unified := range []bool{true, false} {
		for _, n := range []int{1, 2, 4, 8} {
			b.Run(fmt.Sprintf("unified=%v/seqs=%d", unified, n), func(b *testing.B) {
				e := benchEngine(b, func(c *Config) { c.UnifiedKV = unified })
				const gen = 64
				var tokens, seconds float64
				for b.Loop() {
					events := make([][]time.Time, n)
					var wg sync.WaitGroup
					for i := range n {
						wg.Go(func() {
							s, err := e.Submit(context.Background(), Request{
								Prompt: fmt.Sprintf("story %d of the river", i), MaxTokens: gen,
								Sampling: Sampling{Temperature: 0.8, TopP: 1, Seed: int64(i)}})
							if err != nil {
								b.Error(err)
								return
							}
							for {
								if _, err := s.Recv(); err != nil {
									break
								}
								events[i] = append(events[i], time.Now())
							}
						})
					}
					wg.Wait()
					t, s := measure.SteadyRate(events)
					tokens += t
					seconds += s
				}
				b.ReportMetric(tokens/seconds, "tok/s")
				st := e.Stats()
				b.ReportMetric(float64(st.StepTimeMicros)/float64(st.Steps)/1000, "ms/step")
				b.ReportMetric(0, "ns/op")
			})
		}
	}
}

// BenchmarkFollowUpTTFT compares the time to first token of a follow-up turn whose ~1,000
// token history is cached against a cold prefill of the same prompt.
func BenchmarkFollowUpTTFT(b *testing.B) {
	e := benchEngine(b, nil)
	history := strings.Repeat("the quiet river runs past the old stone bridge and the green garden ", 70)
	turn1 := "<|im_start|>user\n" + history + "<|im_end|>\n<|im_start|>assistant\n"
	turn2 := turn1 + "the sea<|im_end|>\n<|im_start|>user\nand then<|im_end|>\n<|im_start|>assistant\n"
	ttft := func(session, prompt string) (time.Duration, Result) {
		s, err := e.Submit(context.Background(), Request{SessionID: session, Prompt: prompt, MaxTokens: 1, Sampling: Greedy()})
		if err != nil {
			b.Fatal(err)
		}
		_, res, err := s.Collect()
		if err != nil {
			b.Fatal(err)
		}
		return res.FirstToken, res
	}
	var cold, warm time.Duration
	var cached, prompt int
	i := 0
	for b.Loop() {
		i++
		c, _ := ttft(fmt.Sprint("cold", i), turn2)
		ttft(fmt.Sprint("warm", i), turn1)
		w, res := ttft(fmt.Sprint("warm", i), turn2)
		cold += c
		warm += w
		cached, prompt = res.CachedTokens, res.PromptTokens
	}
	b.ReportMetric(float64(cold.Milliseconds())/float64(i), "cold-ms")
	b.ReportMetric(float64(warm.Microseconds())/1000/float64(i), "warm-ms")
	b.ReportMetric(float64(cold)/float64(warm), "speedup")
	b.ReportMetric(float64(cached), "cached-tokens")
	b.ReportMetric(float64(prompt), "prompt-tokens")
	b.ReportMetric(0, "ns/op")
}

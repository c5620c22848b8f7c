package llama

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/infernode/infernode/internal/measure"
)

// BenchmarkRawDecode is llama.cpp alone, the floor under every other decode number: n
// sequences prefilled, then decoded together in one batch a step, each row sampled on
// this goroutine (greedy, or at temperature 0.8 as BenchmarkDecode and loadgen sample),
// nothing else (no engine, no HTTP), on INFERNODE_BENCH_MODEL with 2 threads. tok/s
// counts decode steps only, as the engine's and loadgen's steady rates do; sample-ms is
// the sampling time of one step.
func BenchmarkRawDecode(b *testing.B) {
	m := benchModel(b)
	for _, sc := range []struct {
		n    int
		temp float32
	}{{1, 0}, {8, 0}, {1, 0.8}, {8, 0.8}} {
		n := sc.n
		b.Run(fmt.Sprintf("seqs=%d/temp=%g", n, sc.temp), func(b *testing.B) {
			c, err := NewContext(m, ContextParams{Cells: 8192, Sequences: 8, Batch: 512, Threads: 2, Unified: true, FlashAttn: true})
			if err != nil {
				b.Fatal(err)
			}
			defer c.Close()
			batch := NewBatch(512)
			defer batch.Free()
			samplers := make([]*Sampler, n)
			for i := range samplers {
				samplers[i] = must(NewSampler(m, SamplerParams{Temperature: sc.temp, TopP: 1, Seed: uint32(i)}))
				defer samplers[i].Free()
			}
			const gen = 64
			var tokens, steps int
			var took, sampling time.Duration
			var switches int64
			for b.Loop() {
				c.Clear()
				batch.Clear()
				idx := make([]int, n)
				pos := make([]int, n)
				for s := range n {
					prompt, _ := m.Tokenize(fmt.Sprintf("story %d of the river", s)+strings.Repeat(" and the sea", 4), true, false)
					for i, tok := range prompt {
						idx[s] = batch.Add(tok, i, s, i == len(prompt)-1)
					}
					pos[s] = len(prompt)
				}
				if err := c.Decode(batch); err != nil {
					b.Fatal(err)
				}
				start, cs := time.Now(), measure.ContextSwitches()
				for range gen {
					next := make([]int32, n)
					t := time.Now()
					for s := range n {
						next[s] = samplers[s].Sample(c.Logits(idx[s]))
					}
					sampling += time.Since(t)
					steps++
					batch.Clear()
					for s := range n {
						idx[s] = batch.Add(next[s], pos[s], s, true)
						pos[s]++
					}
					if err := c.Decode(batch); err != nil {
						b.Fatal(err)
					}
				}
				took += time.Since(start)
				switches += measure.ContextSwitches() - cs
				tokens += gen * n
			}
			b.ReportMetric(float64(tokens)/took.Seconds(), "tok/s")
			b.ReportMetric(sampling.Seconds()*1000/float64(steps), "sample-ms")
			b.ReportMetric(float64(switches)/float64(steps), "ctxsw/step")
			b.ReportMetric(0, "ns/op")
		})
	}
}

// BenchmarkRawFirstToken is llama.cpp alone answering one request on an idle context:
// a prompt of N tokens prefilled in one batch and its first token sampled (first-token-ms),
// then one decode step of that sequence and its sample (step-ms). These are the latency
// targets no server can beat on this machine; cmd/benchcompare's goodput mode takes its
// SLOs from them, the same for every server, at the prompt length it asks for
// (INFERNODE_RAW_PROMPT_TOKENS; unset, a few lengths). INFERNODE_BENCH_MODEL, 2 threads
// (INFERNODE_RAW_THREADS: as many as the servers compared get), greedy.
func BenchmarkRawFirstToken(b *testing.B) {
	m := benchModel(b)
	lengths := []int{32, 128, 512, 1024}
	if v := os.Getenv("INFERNODE_RAW_PROMPT_TOKENS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > 2048 {
			b.Fatalf("INFERNODE_RAW_PROMPT_TOKENS=%q: want 1 to 2048 tokens", v)
		}
		lengths = []int{n}
	}
	threads := 2
	if v := os.Getenv("INFERNODE_RAW_THREADS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			b.Fatalf("INFERNODE_RAW_THREADS=%q: want 1 or more", v)
		}
		threads = n
	}
	flash := os.Getenv("INFERNODE_RAW_FLASH") != "0" // 0: without flash attention, as ollama's CPU runner
	words, _ := m.Tokenize(strings.Repeat(" river stone bridge garden", 1024), false, false)
	for _, n := range lengths {
		b.Run(fmt.Sprintf("tokens=%d", n), func(b *testing.B) {
			c, err := NewContext(m, ContextParams{Cells: 4096, Sequences: 1, Batch: 2048, Threads: threads, Unified: true, FlashAttn: flash})
			if err != nil {
				b.Fatal(err)
			}
			defer c.Close()
			batch := NewBatch(2048)
			defer batch.Free()
			sampler := must(NewSampler(m, SamplerParams{TopP: 1}))
			defer sampler.Free()
			var first, step time.Duration
			for b.Loop() {
				c.Clear()
				batch.Clear()
				var idx int
				for i, tok := range words[:n] {
					idx = batch.Add(tok, i, 0, i == n-1)
				}
				start := time.Now()
				if err := c.Decode(batch); err != nil {
					b.Fatal(err)
				}
				next := sampler.Sample(c.Logits(idx))
				first += time.Since(start)
				start = time.Now()
				batch.Clear()
				idx = batch.Add(next, n, 0, true)
				if err := c.Decode(batch); err != nil {
					b.Fatal(err)
				}
				sampler.Sample(c.Logits(idx))
				step += time.Since(start)
			}
			b.ReportMetric(first.Seconds()*1000/float64(b.N), "first-token-ms")
			b.ReportMetric(step.Seconds()*1000/float64(b.N), "step-ms")
			b.ReportMetric(0, "ns/op")
		})
	}
}

// benchModel loads INFERNODE_BENCH_MODEL for b, closed when b ends; b is skipped without it.
// INFERNODE_RAW_MMAP=1 maps its file (see ModelParams.MMap).
func benchModel(b *testing.B) *Model {
	path := os.Getenv("INFERNODE_BENCH_MODEL")
	if path == "" {
		b.Skip("INFERNODE_BENCH_MODEL not set; run through make bench")
	}
	m, err := LoadModel(path, ModelParams{MMap: os.Getenv("INFERNODE_RAW_MMAP") == "1"})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(m.Close)
	return m
}

// BenchmarkSeqState is what moving a sequence's cells out of the pool and back costs
// (the session's idle histories in host memory, hand-offs, replicas): a history of 1,024
// tokens whose cells lie in one run (prefilled alone) or interleaved with another
// sequence's, cell by cell (as two conversations decoding side by side leave them),
// copied out into a new buffer (keep.Fresh) or one touched before, and put back.
// INFERNODE_BENCH_MODEL, 2 threads.
func BenchmarkSeqState(b *testing.B) {
	m := benchModel(b)
	const n = 1024
	for _, layout := range []string{"contiguous", "interleaved"} {
		for _, fresh := range []bool{true, false} {
			b.Run(fmt.Sprintf("%s/fresh-buf=%v", layout, fresh), func(b *testing.B) {
				c, err := NewContext(m, ContextParams{Cells: 8192, Sequences: 8, Batch: 2 * n, Threads: 2, Unified: true, FlashAttn: true})
				if err != nil {
					b.Fatal(err)
				}
				defer c.Close()
				batch := NewBatch(2 * n)
				defer batch.Free()
				seqs := 1
				if layout == "interleaved" {
					seqs = 2
				}
				for i := range n {
					for s := range seqs {
						batch.Add(int32(100+(i*7+s)%500), i, s, false)
					}
				}
				var buf []byte
				if !fresh { // touched once before
					if err := c.Decode(batch); err != nil {
						b.Fatal(err)
					}
					if buf, err = c.SeqState(0, nil); err != nil {
						b.Fatal(err)
					}
				}
				var out, back time.Duration
				for b.Loop() {
					// Prefilled again each time: the state goes back in one run.
					c.Clear()
					if err := c.Decode(batch); err != nil {
						b.Fatal(err)
					}
					if fresh {
						buf = nil
					}
					t := time.Now()
					state, err := c.SeqState(0, buf)
					if err != nil {
						b.Fatal(err)
					}
					c.SeqRemove(0, 0, -1)
					out += time.Since(t)
					t = time.Now()
					if err := c.SetSeqState(0, state); err != nil {
						b.Fatal(err)
					}
					back += time.Since(t)
					buf = state
				}
				b.ReportMetric(float64(out.Microseconds())/float64(b.N)/n, "out-µs/cell")
				b.ReportMetric(float64(back.Microseconds())/float64(b.N)/n, "back-µs/cell")
				b.ReportMetric(0, "ns/op")
			})
		}
	}
}

// BenchmarkRawHistory is llama.cpp alone on the work of a multi-turn load: conversations
// with histories of 768 tokens each in the cache, then a follow-up turn of one of them
// (160 new tokens prefilled: followup-ms) and a step of every one decoding a token
// (step-ms). The pool is unified with 1, 3 or 8 histories resident (infernode moves idle
// ones to host memory), or partitioned with 8 (ollama's layout); flash attention on or
// off. INFERNODE_BENCH_MODEL, 1 thread (as each backend of the cluster comparison has).
func BenchmarkRawHistory(b *testing.B) {
	m := benchModel(b)
	words, _ := m.Tokenize(strings.Repeat(" river stone bridge garden", 1024), false, false)
	const hist, turn = 768, 160
	for _, layout := range []struct {
		unified  bool
		resident int
	}{{true, 1}, {true, 3}, {true, 8}, {false, 8}} {
		for _, flash := range []bool{true, false} {
			b.Run(fmt.Sprintf("unified=%v/resident=%d/flash=%v", layout.unified, layout.resident, flash), func(b *testing.B) {
				c, err := NewContext(m, ContextParams{Cells: 8192, Sequences: 8, Batch: 512, Threads: 1, Unified: layout.unified, FlashAttn: flash})
				if err != nil {
					b.Fatal(err)
				}
				defer c.Close()
				batch := NewBatch(512)
				defer batch.Free()
				var followUp, step time.Duration
				for b.Loop() {
					c.Clear()
					for s := range layout.resident {
						for from := 0; from < hist; from += 512 {
							batch.Clear()
							for i := from; i < min(from+512, hist); i++ {
								batch.Add(words[(i+s)%len(words)], i, s, false)
							}
							if err := c.Decode(batch); err != nil {
								b.Fatal(err)
							}
						}
					}
					batch.Clear()
					for i := range turn {
						batch.Add(words[i], hist+i, 0, i == turn-1)
					}
					start := time.Now()
					if err := c.Decode(batch); err != nil {
						b.Fatal(err)
					}
					followUp += time.Since(start)
					batch.Clear()
					for s := range layout.resident {
						p := hist
						if s == 0 {
							p += turn
						}
						batch.Add(words[s], p, s, true)
					}
					start = time.Now()
					if err := c.Decode(batch); err != nil {
						b.Fatal(err)
					}
					step += time.Since(start)
				}
				b.ReportMetric(followUp.Seconds()*1000/float64(b.N), "followup-ms")
				b.ReportMetric(step.Seconds()*1000/float64(b.N), "step-ms")
				b.ReportMetric(0, "ns/op")
			})
		}
	}
}

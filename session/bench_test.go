package session

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/infernode/infernode/internal/keep"
	"github.com/infernode/infernode/internal/measure"
	"github.com/infernode/infernode/session/infer"
)

// benchEngine runs an engine on INFERNODE_BENCH_MODEL (make bench sets it to the
// SmolLM2-135M-shaped model) for the benchmark's duration, with INFERNODE_BENCH_THREADS
// and INFERNODE_BENCH_PREFILL_SLICE if set.
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
	if d, err := time.ParseDuration(os.Getenv("INFERNODE_BENCH_PREFILL_SLICE")); err == nil {
		cfg.PrefillSlice = d
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
				var tokens, seconds float64
				cs, before := measure.ContextSwitches(), e.Stats()
				for b.Loop() {
					t, s := decodeSteady(b, e, n, 64, "")
					tokens += t
					seconds += s
				}
				b.ReportMetric(tokens/seconds, "tok/s")
				st := e.Stats()
				b.ReportMetric(float64(st.StepTimeMicros)/float64(st.Steps)/1000, "ms/step")
				b.ReportMetric(float64(measure.ContextSwitches()-cs)/float64(st.Steps-before.Steps), "ctxsw/step")
				b.ReportMetric(0, "ns/op")
			})
		}
	}
}

// BenchmarkIdleCells: what the cells idle conversations hold in the unified KV pool cost
// the streams decoding beside them. Every token attends over the pool's whole used range:
// the mask hides other sequences' cells, but flash attention still reads the mask of
// every cell, for every head of every layer. So n streams decode slower when the other
// sequences hold long idle histories (cached for their follow-ups) than when they hold
// none; "idle=6-host" is the same six histories with Config.HostKV, which moves them to
// host memory once the streams have decoded beside them for a few steps.
func BenchmarkIdleCells(b *testing.B) {
	for _, c := range []struct {
		name string
		idle int
		host bool
	}{{"idle=0", 0, false}, {"idle=6", 6, false}, {"idle=6-host", 6, true}} {
		for _, n := range []int{1, 2} {
			b.Run(fmt.Sprintf("%s/seqs=%d", c.name, n), func(b *testing.B) {
				// Six histories of this model fill more than one pool's cells (the
				// default bound of host memory): give host memory two.
				e := benchEngine(b, func(cfg *Config) { cfg.HostKV, cfg.HostCells = c.host, 2*cfg.Cells })
				history := strings.Repeat(" a long and winding tale of the sea", 150) // 1,955 tokens with the story line, on the realistic shape
				for i := range c.idle {
					s, err := e.Submit(context.Background(), infer.Request{SessionID: fmt.Sprint("idle-", i),
						Prompt: fmt.Sprintf("story %d:", i) + history, MaxTokens: 1, Sampling: infer.Sampling{TopP: 1}})
					if err != nil {
						b.Fatal(err)
					}
					if _, _, err := s.Collect(); err != nil {
						b.Fatal(err)
					}
				}
				var tokens, seconds float64
				before := e.Stats()
				for b.Loop() {
					t, s := decodeSteady(b, e, n, 64, "")
					tokens += t
					seconds += s
				}
				st := e.Stats()
				b.ReportMetric(tokens/seconds, "tok/s")
				b.ReportMetric(float64(st.StepTimeMicros-before.StepTimeMicros)/float64(st.Steps-before.Steps)/1000, "ms/step")
				b.ReportMetric(float64(before.KVUsed), "idle-cells")
				b.ReportMetric(float64(st.HostTokens), "host-tokens")
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
	ttft := func(session, prompt string) (time.Duration, infer.Result) {
		s, err := e.Submit(context.Background(), infer.Request{SessionID: session, Prompt: prompt, MaxTokens: 1, Sampling: infer.Greedy()})
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

// BenchmarkImportStall measures what importing conversations' KV costs the streams
// decoding beside them: the inter-token latency of 4 greedy streams (96 tokens each, in
// steady state) while four ~1,000-token conversations are imported between their steps,
// against the same streams with no import, alternating in each iteration.
func BenchmarkImportStall(b *testing.B) {
	src := benchEngine(b, nil)
	e := benchEngine(b, func(c *Config) { c.Sequences = 8 })
	history := strings.Repeat("the quiet river runs past the old stone bridge and the green garden ", 70)
	const streams, imports, gen = 4, 4, 96
	run := func(frames [][]byte) (gaps []time.Duration, stalls []time.Duration) {
		var mu sync.Mutex
		var wg sync.WaitGroup
		var started sync.WaitGroup
		started.Add(streams)
		for i := range streams {
			wg.Go(func() {
				s, err := e.Submit(context.Background(), infer.Request{Prompt: fmt.Sprintf("story %d of the river", i), MaxTokens: gen, Sampling: infer.Greedy()})
				if err != nil {
					b.Error(err)
					started.Done()
					return
				}
				var last time.Time
				for n := 0; ; n++ {
					if _, err := s.Recv(); err != nil {
						break
					}
					now := time.Now()
					if n == 8 {
						started.Done() // decoding in steady state
					}
					if n > 8 && n < gen-8 {
						mu.Lock()
						gaps = append(gaps, now.Sub(last))
						mu.Unlock()
					}
					last = now
				}
			})
		}
		started.Wait()
		for _, f := range frames {
			steps := e.Stats().Steps
			for e.Stats().Steps < steps+12 {
				time.Sleep(time.Millisecond)
			}
			res, err := e.Import(context.Background(), f, infer.Pushed, "")
			if err != nil {
				b.Fatal(err)
			}
			stalls = append(stalls, res.Stall)
		}
		wg.Wait()
		slices.Sort(gaps)
		return gaps, stalls
	}
	pct := func(d []time.Duration, p float64) float64 {
		return float64(d[min(len(d)-1, int(float64(len(d))*p))].Microseconds()) / 1000
	}
	var base, with []time.Duration
	var stall time.Duration
	var tokens, frameBytes int
	round := 0
	for b.Loop() {
		round++
		frames := make([][]byte, imports)
		for i := range frames {
			key := fmt.Sprintf("moved-%d-%d", round, i)
			s, err := src.Submit(context.Background(), infer.Request{SessionID: key, Prompt: fmt.Sprint(i, " ", history), MaxTokens: 1, Sampling: infer.Greedy()})
			if err != nil {
				b.Fatal(err)
			}
			s.Collect()
			var buf bytes.Buffer
			n, err := src.Export(context.Background(), key, &buf)
			if err != nil {
				b.Fatal(err)
			}
			frames[i], tokens, frameBytes = buf.Bytes(), n, buf.Len()
		}
		g, _ := run(nil)
		base = append(base, g...)
		g, stalls := run(frames)
		with = append(with, g...)
		for _, s := range stalls {
			stall = max(stall, s)
		}
	}
	slices.Sort(base)
	slices.Sort(with)
	b.ReportMetric(pct(base, 0.5), "base-p50-ms")
	b.ReportMetric(pct(base, 0.99), "base-p99-ms")
	b.ReportMetric(pct(with, 0.5), "import-p50-ms")
	b.ReportMetric(pct(with, 0.99), "import-p99-ms")
	b.ReportMetric(pct(with, 0.99)/pct(base, 0.99), "p99-ratio")
	b.ReportMetric(float64(stall.Microseconds())/1000, "max-stall-ms")
	b.ReportMetric(float64(tokens), "tokens")
	b.ReportMetric(float64(frameBytes)/1e6, "frame-MB")
	b.ReportMetric(0, "ns/op")
}

// BenchmarkQuant measures the weight and KV cache types side by side on one machine: for
// every model in INFERNODE_QUANT_MODELS (paths separated by commas; make bench-quant gives
// the realistic shape in F16, Q8_0, Q4_K_M and Q4_0) with an f16 cache, then for the first
// with q8_0 and q4_0 caches, all at the default 8,192 cells: decode tokens/s with 1 and 8
// streams (as BenchmarkDecode) and with 8 streams of about 900 tokens each (the cache
// nearly full), prefill tokens/s of one 1,000-token prompt, the model file's size and the
// memory the engine made resident (model, KV cache and compute buffers: the process's RSS
// from before the load to after the runs).
func BenchmarkQuant(b *testing.B) {
	paths := strings.Split(os.Getenv("INFERNODE_QUANT_MODELS"), ",")
	if paths[0] == "" {
		b.Skip("INFERNODE_QUANT_MODELS not set; run through make bench-quant")
	}
	type run struct{ path, kv string }
	var runs []run
	for _, p := range paths {
		runs = append(runs, run{p, "f16"})
	}
	runs = append(runs, run{paths[0], "q8_0"}, run{paths[0], "q4_0"})
	for _, r := range runs {
		name := strings.TrimSuffix(filepath.Base(r.path), ".gguf")
		b.Run(fmt.Sprintf("weights=%s/kv=%s", name, r.kv), func(b *testing.B) {
			info, err := os.Stat(r.path)
			if err != nil {
				b.Fatal(err)
			}
			before := rss(b)
			cfg := DefaultConfig()
			cfg.ModelPath, cfg.KVType, cfg.Seed = r.path, r.kv, 1
			cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
			e := runEngine(b, cfg)
			long := strings.Repeat("the river ran past the old mill and the children ", 100)
			for b.Loop() {
				for _, n := range []int{1, 8} {
					tokens, seconds := decodeSteady(b, e, n, 64, "")
					b.ReportMetric(tokens/seconds, fmt.Sprintf("tok/s-%d", n))
				}
				// Eight conversations of about 900 tokens each: the cache nearly full.
				tokens, seconds := decodeSteady(b, e, 8, 64, strings.Repeat(" and the children", 300))
				b.ReportMetric(tokens/seconds, "tok/s-8-full")
				start := time.Now()
				s, err := e.Submit(context.Background(), infer.Request{Prompt: long, MaxTokens: 1, Sampling: infer.Sampling{TopP: 1}})
				if err != nil {
					b.Fatal(err)
				}
				for err == nil {
					_, err = s.Recv()
				}
				res := s.Result()
				b.ReportMetric(float64(res.PromptTokens)/time.Since(start).Seconds(), "prefill-tok/s")
			}
			b.ReportMetric(float64(info.Size())/1e6, "file-MB")
			b.ReportMetric(float64(rss(b)-before)/1e6, "rss-MB")
			b.ReportMetric(0, "ns/op")
		})
	}
}

// decodeSteady has n requests generate gen tokens each at once and returns the tokens and
// seconds of the steady window (measure.SteadyRate). With a history, each request's
// conversation is first prefilled with it (cached), so all n start decoding together over
// long contexts.
func decodeSteady(b *testing.B, e *Engine, n, gen int, history string) (tokens, seconds float64) {
	events := make([][]time.Time, n)
	run := func(i int, prompt string, gen int) {
		var session string // a conversation only when its history is cached first
		if history != "" {
			session = fmt.Sprint("steady-", i)
		}
		s, err := e.Submit(context.Background(), infer.Request{
			SessionID: session, Prompt: fmt.Sprintf("story %d of the river", i) + prompt,
			MaxTokens: gen, Sampling: infer.Sampling{Temperature: 0.8, TopP: 1, Seed: int64(i)}})
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
	}
	if history != "" {
		for i := range n {
			run(i, history, 1)
		}
		clear(events)
		history += " and then"
	}
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { run(i, history, gen) })
	}
	wg.Wait()
	return measure.SteadyRate(events)
}

// rss is the process's resident memory in bytes.
func rss(b *testing.B) int64 {
	status, err := os.ReadFile("/proc/self/status")
	if err != nil {
		b.Fatal(err)
	}
	for line := range strings.Lines(string(status)) {
		if kb, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			n, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(kb), "kB")), 10, 64)
			if err != nil {
				b.Fatal(err)
			}
			return n << 10
		}
	}
	b.Fatal("no VmRSS in /proc/self/status")
	return 0
}

// BenchmarkShortBehindLong: a 1,500-token prompt arrives, then four short ones just
// after it. The time to first token of the short ones shows whether they wait behind the
// long prefill (first come, first served) or go first (shortest prompt first).
func BenchmarkShortBehindLong(b *testing.B) {
	e := benchEngine(b, nil)
	long := strings.Repeat("the quiet river runs past the old stone bridge and the garden ", 110)
	var short, longTTFT []time.Duration
	for i := 0; b.Loop(); i++ {
		submit := func(prompt string) *Stream {
			s, err := e.Submit(context.Background(), infer.Request{Prompt: prompt, MaxTokens: 2, Sampling: infer.Sampling{TopP: 1}})
			if err != nil {
				b.Fatal(err)
			}
			for _, _, ok := s.Admitted(); !ok; _, _, ok = s.Admitted() {
				time.Sleep(100 * time.Microsecond) // admitted within a step
			}
			return s
		}
		ttft := func(s *Stream) time.Duration { // the engine's own time from Submit
			_, res, err := s.Collect()
			if err != nil {
				b.Fatal(err)
			}
			return res.FirstToken
		}
		l := submit(fmt.Sprintf("%d %s", i, long)) // admitted before the short ones arrive
		var shorts []*Stream
		for k := range 4 {
			shorts = append(shorts, submit(fmt.Sprintf("story %d of %d by the river", k, i)))
		}
		for _, s := range shorts {
			short = append(short, ttft(s))
		}
		longTTFT = append(longTTFT, ttft(l))
	}
	b.ReportMetric(float64(measure.Percentile(short, 50).Milliseconds()), "short-p50-ms")
	b.ReportMetric(float64(measure.Percentile(short, 100).Milliseconds()), "short-max-ms")
	b.ReportMetric(float64(measure.Percentile(longTTFT, 50).Milliseconds()), "long-ms")
	b.ReportMetric(0, "ns/op")
}

// BenchmarkSharedPrefix: the first token of a conversation that begins with a
// 1,000-token system prompt another conversation here began with (its cells shared),
// against one whose system prompt is new to the node (prefilled in full).
func BenchmarkSharedPrefix(b *testing.B) {
	e := benchEngine(b, nil)
	ask := func(system, conv, question string) time.Duration {
		prompt := "<|im_start|>system\n" + system + "<|im_end|>\n<|im_start|>user\n" + question + "<|im_end|>\n<|im_start|>assistant\n"
		s, err := e.Submit(context.Background(), infer.Request{SessionID: conv, Prompt: prompt, MaxTokens: 1, Sampling: infer.Greedy()})
		if err != nil {
			b.Fatal(err)
		}
		if _, _, err := s.Collect(); err != nil {
			b.Fatal(err)
		}
		return s.Result().FirstToken
	}
	var cold, shared []time.Duration
	for i := 0; b.Loop(); i++ {
		system := fmt.Sprintf("%d: %s", i, strings.Repeat("you answer questions about the quiet river and the old stone bridge ", 75))
		cold = append(cold, ask(system, fmt.Sprintf("a%d", i), "where does the river run"))
		shared = append(shared, ask(system, fmt.Sprintf("b%d", i), "what lives in the river"))
	}
	b.ReportMetric(float64(measure.Percentile(cold, 50).Milliseconds()), "new-prefix-ms")
	b.ReportMetric(float64(measure.Percentile(shared, 50).Milliseconds()), "shared-prefix-ms")
	b.ReportMetric(0, "ns/op")
}

// BenchmarkSharedPrefixBurst: 8 conversations arrive at once, each with a 400-token system
// prompt, one system prompt for all of them or a different one each: the time until the
// last of them has its first token.
func BenchmarkSharedPrefixBurst(b *testing.B) {
	e := benchEngine(b, nil)
	burst := func(system func(k int) string, i int) time.Duration {
		var streams []*Stream
		for k := range 8 {
			prompt := "<|im_start|>system\n" + system(k) + "<|im_end|>\n<|im_start|>user\nquestion " + strconv.Itoa(k) + "<|im_end|>\n<|im_start|>assistant\n"
			s, err := e.Submit(context.Background(), infer.Request{SessionID: fmt.Sprint(i, "-", k), Prompt: prompt, MaxTokens: 1, Sampling: infer.Greedy()})
			if err != nil {
				b.Fatal(err)
			}
			streams = append(streams, s)
		}
		var last time.Duration
		for _, s := range streams {
			if _, _, err := s.Collect(); err != nil {
				b.Fatal(err)
			}
			last = max(last, s.Result().FirstToken)
		}
		return last
	}
	text := strings.Repeat("you answer questions about the quiet river and the old stone bridge ", 30)
	var one, each []time.Duration
	for i := 0; b.Loop(); i++ {
		one = append(one, burst(func(int) string { return fmt.Sprintf("%d: %s", i, text) }, i))
		each = append(each, burst(func(k int) string { return fmt.Sprintf("%d.%d: %s", i, k, text) }, i))
	}
	b.ReportMetric(float64(measure.Percentile(one, 50).Milliseconds()), "one-prompt-ms")
	b.ReportMetric(float64(measure.Percentile(each, 50).Milliseconds()), "prompt-each-ms")
	b.ReportMetric(0, "ns/op")
}

// BenchmarkBatchPriority: the first token of an interactive request (a 200-word prompt,
// new each time) on an idle engine of 8 sequences, beside 6 batch streams decoding, and
// beside 6 interactive ones. Then of bursts of 3 short requests (a 12-word prompt) at once,
// where beside the batch streams (which leave 2 sequences free) the third of each burst
// preempts one, or without preemption (NoPreempt) waits for one to end; with the
// background's tokens a second (the spare capacity batch work fills) and the preemptions
// a burst.
func BenchmarkBatchPriority(b *testing.B) {
	long := strings.Repeat("the quiet river runs past the old stone bridge ", 25)
	short := "the quiet river runs past the old stone bridge and the garden"
	for _, bg := range []struct {
		name                      string
		batch, interactive, burst int
		noPreempt                 bool
	}{{"idle", 0, 0, 1, false}, {"batch", 6, 0, 1, false}, {"interactive", 0, 6, 1, false},
		{"idle/burst=3", 0, 0, 3, false}, {"batch/burst=3", 6, 0, 3, false},
		{"batch-nopreempt/burst=3", 6, 0, 3, true}, {"interactive/burst=3", 0, 6, 3, false}} {
		b.Run("background="+bg.name, func(b *testing.B) {
			e := benchEngine(b, func(c *Config) { c.Sequences, c.NoPreempt = 8, bg.noPreempt })
			probe := long
			if bg.burst > 1 {
				probe = short
			}
			ctx, cancel := context.WithCancel(context.Background())
			var wg sync.WaitGroup
			var generated sync.Map
			for i := range bg.batch + bg.interactive {
				wg.Go(func() {
					for k := 0; ctx.Err() == nil; k++ {
						st, err := e.Submit(ctx, infer.Request{Prompt: fmt.Sprintf("background %d story %d", i, k), MaxTokens: 400,
							Batch: i < bg.batch, Sampling: infer.Sampling{TopP: 1}})
						if err != nil {
							time.Sleep(10 * time.Millisecond)
							continue
						}
						_, res, _ := st.Collect()
						v, _ := generated.LoadOrStore(i, new(int))
						*v.(*int) += res.CompletionTokens
					}
				})
			}
			if bg.batch+bg.interactive > 0 {
				time.Sleep(2 * time.Second) // every stream decoding
			}
			var ttft []time.Duration
			start, preempted, bursts := time.Now(), e.Stats().Preemptions, 0
			for i := 0; b.Loop(); i++ {
				var streams []*Stream
				for k := range bg.burst {
					prompt := fmt.Sprintf("%d.%d %s", i, k, probe)
					st, err := e.Submit(context.Background(), infer.Request{Prompt: prompt, MaxTokens: 4, Sampling: infer.Sampling{TopP: 1}})
					if err != nil {
						b.Fatal(err)
					}
					streams = append(streams, st)
				}
				for _, st := range streams {
					_, res, err := st.Collect()
					if err != nil {
						b.Fatal(err)
					}
					ttft = append(ttft, res.FirstToken)
				}
				bursts++
				time.Sleep(200 * time.Millisecond) // arrivals, not a closed loop
			}
			took, preempted := time.Since(start), e.Stats().Preemptions-preempted
			cancel()
			wg.Wait()
			tokens := 0
			generated.Range(func(_, v any) bool { tokens += *v.(*int); return true })
			b.ReportMetric(float64(measure.Percentile(ttft, 50).Milliseconds()), "ttft-p50-ms")
			b.ReportMetric(float64(measure.Percentile(ttft, 99).Milliseconds()), "ttft-p99-ms")
			b.ReportMetric(float64(tokens)/took.Seconds(), "background-tok/s")
			b.ReportMetric(float64(preempted)/float64(bursts), "preemptions/burst")
			b.ReportMetric(0, "ns/op")
		})
	}
}

// BenchmarkKVFrame times the engine's ends of a KV transfer for a conversation of about
// 1,000 tokens: Snapshot (the state copied out of llama.cpp, on the engine goroutine),
// writing the frame (its header and state) to memory, and Import into a second engine
// (parse, checks, the state copied in), each as MB/s of the frame.
func BenchmarkKVFrame(b *testing.B) {
	src := benchEngine(b, nil)
	dst := benchEngine(b, nil)
	history := strings.Repeat("the quiet river runs past the old stone bridge and the green garden ", 70)
	var snap, write, imp time.Duration
	var size, tokens int
	i := 0
	for b.Loop() {
		i++
		key := fmt.Sprintf("frame-%d", i)
		s, err := src.Submit(context.Background(), infer.Request{SessionID: key, Prompt: history, MaxTokens: 1, Sampling: infer.Greedy()})
		if err != nil {
			b.Fatal(err)
		}
		s.Collect()
		start := time.Now()
		f, err := src.Snapshot(context.Background(), key)
		if err != nil {
			b.Fatal(err)
		}
		snap += time.Since(start)
		var buf bytes.Buffer
		buf.Grow(f.Len())
		start = time.Now()
		if _, err := f.WriteTo(&buf); err != nil {
			b.Fatal(err)
		}
		write += time.Since(start)
		f.Release()
		start = time.Now()
		if _, err := dst.Import(context.Background(), buf.Bytes(), infer.Pushed, ""); err != nil {
			b.Fatal(err)
		}
		imp += time.Since(start)
		size, tokens = buf.Len(), f.Tokens()
	}
	rate := func(d time.Duration) float64 { return float64(size) * float64(i) / d.Seconds() / 1e6 }
	b.ReportMetric(float64(size)/1e6, "frame-MB")
	b.ReportMetric(float64(tokens), "tokens")
	b.ReportMetric(rate(snap), "snapshot-MB/s")
	b.ReportMetric(rate(write), "write-MB/s")
	b.ReportMetric(rate(imp), "import-MB/s")
	b.ReportMetric(0, "ns/op")
}

// BenchmarkFirstTouch: what memory the process has not touched, or gave back to the
// kernel, costs on its first touch: 32 MB allocated and written a byte a page, after
// debug.FreeOSMemory; from make (4 KiB pages), or from keep.Fresh (marked for huge
// pages). Why buffers of KV frames and of states in host memory are kept (see stateBufs,
// Engine.spare), and fresh ones come from keep.Fresh.
func BenchmarkFirstTouch(b *testing.B) {
	const size = 32 << 20
	for _, c := range []struct {
		name  string
		alloc func(int) []byte
	}{{"make", func(n int) []byte { return make([]byte, n) }}, {"fresh", func(n int) []byte { return keep.Fresh(n)[:n] }}} {
		b.Run(c.name, func(b *testing.B) {
			var took time.Duration
			n := 0
			for b.Loop() {
				debug.FreeOSMemory()
				start := time.Now()
				buf := c.alloc(size)
				for i := 0; i < len(buf); i += os.Getpagesize() {
					buf[i] = 1
				}
				took += time.Since(start)
				n++
			}
			b.ReportMetric(float64(took.Microseconds())/1000/float64(n), "ms/32MB")
			b.ReportMetric(float64(took.Nanoseconds())/1000/float64(n)/float64(size/os.Getpagesize()), "µs/page")
			b.ReportMetric(0, "ns/op")
		})
	}
}

package answers

import (
	"errors"
	"io"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/infernode/infernode/session/infer"
)

// fakeStream streams pieces, then ends with res.
type fakeStream struct {
	pieces []string
	res    infer.Result
}

func (f *fakeStream) Recv() (string, error) {
	if len(f.pieces) == 0 {
		if f.res.Err != nil {
			return "", f.res.Err
		}
		return "", io.EOF
	}
	p := f.pieces[0]
	f.pieces = f.pieces[1:]
	return p, nil
}
func (f *fakeStream) Result() infer.Result                  { return f.res }
func (f *fakeStream) Admitted() (int, int, bool)            { return f.res.PromptTokens, 0, true }
func (f *fakeStream) Source() infer.Origin                  { return infer.Local }
func (f *fakeStream) Tokens() int                           { return f.res.CompletionTokens }
func (f *fakeStream) Continuation(int) ([]int32, int, bool) { return []int32{7}, 0, true }

// engine counts what it computes.
type engine struct{ computed int }

func (e *engine) submit(text string, err error) func() (infer.Stream, error) {
	return func() (infer.Stream, error) {
		e.computed++
		res := infer.Result{FinishReason: "stop", PromptTokens: 12, CompletionTokens: 3, Err: err,
			Logprobs: []infer.TokenLogprob{{Token: "a", Logprob: -0.5}}, Total: time.Second}
		return &fakeStream{pieces: strings.SplitAfter(text, " "), res: res}, nil
	}
}

func read(t *testing.T, st infer.Stream) (string, infer.Result) {
	t.Helper()
	var b strings.Builder
	for {
		p, err := st.Recv()
		if err != nil {
			return b.String(), st.Result()
		}
		b.WriteString(p)
	}
}

func greedy(prompt string) infer.Request {
	return infer.Request{Prompt: prompt, CacheAnswer: true, MaxTokens: 10, Share: "tenant-a", Sampling: infer.Greedy()}
}

// TestCache: a greedy request that asks is computed once, then replayed with the same
// text, finish, counts and log probabilities, every prompt token cached and marked as
// from the cache; any difference in what shapes the answer (tenant, prompt, parameters)
// is computed; requests that do not ask, sample, or failed are never kept.
func TestCache(t *testing.T) {
	now := time.Unix(1_800_000_000, 0)
	c := New(DefaultConfig(), "model-fp", func() time.Time { return now })
	e := &engine{}
	serve := func(req infer.Request, text string) (string, infer.Result) {
		st, err := c.Serve(req, e.submit(text, nil))
		if err != nil {
			t.Fatal(err)
		}
		return read(t, st)
	}
	text, res := serve(greedy("hello"), "the answer is here")
	if res.FromCache || text != "the answer is here" || e.computed != 1 {
		t.Fatalf("first ask: %q from cache %v, computed %d", text, res.FromCache, e.computed)
	}
	text, res = serve(greedy("hello"), "something else")
	if !res.FromCache || text != "the answer is here" || e.computed != 1 || res.CachedTokens != 12 || res.CompletionTokens != 3 ||
		res.FinishReason != "stop" || len(res.Logprobs) != 1 || res.Total != 0 {
		t.Errorf("second ask: %q, %+v, computed %d; want the first answer replayed", text, res, e.computed)
	}
	other := func(edit func(*infer.Request)) infer.Request {
		r := greedy("hello")
		edit(&r)
		return r
	}
	for name, req := range map[string]infer.Request{
		"another tenant":       other(func(r *infer.Request) { r.Share = "tenant-b" }),
		"another prompt":       other(func(r *infer.Request) { r.Prompt = "hello!" }),
		"another max_tokens":   other(func(r *infer.Request) { r.MaxTokens = 11 }),
		"another stop":         other(func(r *infer.Request) { r.Stop = []string{"."} }),
		"logprobs":             other(func(r *infer.Request) { r.Logprobs = true }),
		"a schema":             other(func(r *infer.Request) { r.Schema = `{"type":"object"}` }),
		"a repeat penalty":     other(func(r *infer.Request) { r.RepeatPenalty = 1.1 }),
		"token ids":            other(func(r *infer.Request) { r.Tokens = []int32{1, 2} }),
		"sampled":              other(func(r *infer.Request) { r.Temperature = 0.7 }),
		"not asked":            other(func(r *infer.Request) { r.CacheAnswer = false }),
		"a resumed leg":        other(func(r *infer.Request) { r.Continue = []int32{4} }),
		"scored, not answered": other(func(r *infer.Request) { r.PrefillOnly = true }),
	} {
		before := e.computed
		if _, res := serve(req, "computed"); res.FromCache || e.computed != before+1 {
			t.Errorf("%s: answered from the cache", name)
		}
	}
	// The sampled and unasked ones were computed and not kept either.
	for name, req := range map[string]infer.Request{
		"sampled":   other(func(r *infer.Request) { r.Temperature = 0.7 }),
		"not asked": other(func(r *infer.Request) { r.CacheAnswer = false }),
	} {
		if _, res := serve(req, "computed"); res.FromCache {
			t.Errorf("%s: kept", name)
		}
	}
	// A failed answer is not kept.
	st, _ := c.Serve(greedy("fails"), e.submit("half", errors.New("boom")))
	read(t, st)
	if _, res := serve(greedy("fails"), "whole"); res.FromCache {
		t.Error("a failed answer was kept")
	}
	if got := value(t, c.hits); got != 1 {
		t.Errorf("hits %v, want 1", got)
	}
}

// TestBounds: past the TTL an answer is computed again (counted as a ttl eviction); past
// the byte bound the least recently used answer goes (a size eviction); an answer larger
// than the bound is not kept; with no bytes the cache is off.
func TestBounds(t *testing.T) {
	now := time.Unix(1_800_000_000, 0)
	e := &engine{}
	answer := strings.Repeat("word ", 40) // 200 bytes of text, in 40 pieces
	c := New(Config{MaxBytes: 3 * 1200, TTL: time.Minute}, "fp", func() time.Time { return now })
	serve := func(prompt string) bool {
		st, err := c.Serve(greedy(prompt), e.submit(answer, nil))
		if err != nil {
			t.Fatal(err)
		}
		_, res := read(t, st)
		return res.FromCache
	}
	serve("a")
	now = now.Add(time.Minute)
	if serve("a") {
		t.Error("answered past its TTL")
	}
	if got := value(t, c.evicted.WithLabelValues("ttl")); got != 1 {
		t.Errorf("ttl evictions %v, want 1", got)
	}
	serve("b")
	serve("c")
	serve("a") // a hit: a is now the most recently used, b the least
	serve("d") // no room for four: b goes
	if hits := []bool{serve("a"), serve("c"), serve("d")}; !slices.Equal(hits, []bool{true, true, true}) {
		t.Errorf("a, c, d after d came: cached %v", hits)
	}
	if serve("b") {
		t.Error("the least recently used answer was kept past the bound")
	}
	if got := value(t, c.evicted.WithLabelValues("size")); got < 1 {
		t.Errorf("size evictions %v, want at least 1", got)
	}

	big := New(Config{MaxBytes: 100, TTL: time.Minute}, "fp", time.Now)
	for range 2 {
		st, _ := big.Serve(greedy("big"), e.submit(answer, nil))
		if _, res := read(t, st); res.FromCache {
			t.Error("an answer larger than the bound was kept")
		}
	}
	off := New(Config{TTL: time.Minute}, "fp", time.Now)
	for range 2 {
		st, _ := off.Serve(greedy("off"), e.submit(answer, nil))
		if _, res := read(t, st); res.FromCache {
			t.Error("a cache of 0 bytes kept an answer")
		}
	}
}

// TestContinuationPassedOn: a computed answer that goes to the cache still gives a hop
// the tokens its text spells, so it can resume elsewhere from them.
func TestContinuationPassedOn(t *testing.T) {
	c := New(DefaultConfig(), "fp", time.Now)
	st, _ := c.Serve(greedy("x"), (&engine{}).submit("y", nil))
	cs, ok := st.(interface {
		Continuation(int) ([]int32, int, bool)
	})
	if !ok {
		t.Fatal("the recording stream hides Continuation")
	}
	if ids, _, ok := cs.Continuation(0); !ok || !slices.Equal(ids, []int32{7}) {
		t.Errorf("Continuation: %v %v", ids, ok)
	}
}

// value reads a counter.
func value(t *testing.T, c prometheus.Counter) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}

package llama

import (
	"math"
	"os"
	"testing"
	"time"
)

// promptLogits decodes a short prompt and returns the context holding its last row of
// logits, and that row's batch index.
func promptLogits(t testing.TB, m *Model) (*Context, int) {
	t.Helper()
	c, b := testContext(t, m, 512, 1)
	prompt, _ := m.Tokenize("once upon a time the river", true, false)
	var idx int
	for i, tok := range prompt {
		idx = b.Add(tok, i, 0, i == len(prompt)-1)
	}
	if err := c.Decode(b); err != nil {
		t.Fatal(err)
	}
	return c, idx
}

// softmax is the distribution llama.cpp's temperature and draw samplers sample from,
// computed in float64: the reference for the temperature-only path.
func softmax(row []float32, temp float32) []float64 {
	p := make([]float64, len(row))
	hi := math.Inf(-1)
	for i, l := range row {
		p[i] = float64(l / temp)
		hi = max(hi, p[i])
	}
	var sum float64
	for i := range p {
		p[i] = math.Exp(p[i] - hi)
		sum += p[i]
	}
	for i := range p {
		p[i] /= sum
	}
	return p
}

// TestSampleTemperature: the temperature-only path (ggml's vectorized exp on the row)
// inverts the same distribution as the reference, draw by draw, and samples the same
// distribution as llama.cpp's own temp and dist samplers.
func TestSampleTemperature(t *testing.T) {
	m := testModel(t)
	c, idx := promptLogits(t, m)
	const temp = 1.5
	row := c.Logits(idx).Row(m.NumVocab())
	want := softmax(row, temp)

	fast := must(NewSampler(m, SamplerParams{Temperature: temp, TopP: 1, Seed: 1}))
	defer fast.Free()
	if fast.c != nil {
		t.Fatal("a temperature alone built llama.cpp's chain, not the temperature-only path")
	}
	// Draw by draw: the token whose cumulative probability first reaches u, except where u
	// falls within float rounding of a boundary between two tokens.
	var cum float64
	next := 0
	for k := range 2000 {
		u := (float64(k) + 0.5) / 2000
		for next < len(want)-1 && cum+want[next] < u {
			cum += want[next]
			next++
		}
		got := int(fast.draw(c.Logits(idx), u))
		if got != next && math.Abs(cum-u) > 1e-5 && math.Abs(cum+want[next]-u) > 1e-5 {
			t.Fatalf("u=%.5f: drew token %d, want %d (cumulative %.6f to %.6f)", u, got, next, cum, cum+want[next])
		}
	}

	// Sampling: both paths' frequencies agree with the distribution within 5 standard errors
	// for every token of probability 1% or more.
	chain := newChain(m, SamplerParams{Temperature: temp, TopP: 1, Seed: 2})
	defer chain.Free()
	const n = 20000
	for name, s := range map[string]*Sampler{"temperature-only path": fast, "llama.cpp chain": chain} {
		freq := make([]int, len(want))
		for range n {
			freq[s.Sample(c.Logits(idx))]++
		}
		checked := 0
		for tok, p := range want {
			if p < 0.01 {
				continue
			}
			checked++
			if se := math.Sqrt(p * (1 - p) / n); math.Abs(float64(freq[tok])/n-p) > 5*se {
				t.Errorf("%s: token %d drawn %.4f of the time, want %.4f ± %.4f", name, tok, float64(freq[tok])/n, p, 5*se)
			}
		}
		if checked < 3 {
			t.Fatalf("only %d tokens above 1%%: the row is too peaked to compare", checked)
		}
	}
}

// BenchmarkSample is one row sampled at temperature 0.8 by llama.cpp's chain and by the
// temperature-only path, on INFERNODE_BENCH_MODEL (a 49k-token vocabulary) or the test model.
func BenchmarkSample(b *testing.B) {
	path := os.Getenv("INFERNODE_BENCH_MODEL")
	if path == "" {
		path = os.Getenv("INFERNODE_TEST_MODEL")
	}
	if path == "" {
		b.Skip("neither INFERNODE_BENCH_MODEL nor INFERNODE_TEST_MODEL is set")
	}
	m, err := LoadModel(path, ModelParams{})
	if err != nil {
		b.Fatal(err)
	}
	defer m.Close()
	c, idx := promptLogits(b, m)
	for _, sc := range []struct {
		name string
		new  func(*Model, SamplerParams) *Sampler
	}{{"chain", newChain}, {"temperature-only", func(m *Model, p SamplerParams) *Sampler { return must(NewSampler(m, p)) }}} {
		b.Run(sc.name, func(b *testing.B) {
			s := sc.new(m, SamplerParams{Temperature: 0.8})
			defer s.Free()
			start := time.Now()
			for b.Loop() {
				s.Sample(c.Logits(idx))
			}
			b.ReportMetric(float64(time.Since(start).Microseconds())/float64(b.N), "µs/row")
			b.ReportMetric(float64(m.NumVocab()), "vocab")
		})
	}
}

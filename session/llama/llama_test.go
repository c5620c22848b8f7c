package llama

import (
	"errors"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/infernode/infernode/internal/testenv"
)

// testModel loads the model named by INFERNODE_TEST_MODEL (make test sets it to the default
// model) or skips.
func testModel(t *testing.T) *Model {
	t.Helper()
	path := testenv.Model(t)
	m, err := LoadModel(path, ModelParams{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(m.Close)
	return m
}

// testContext makes a unified context of m (cells cells, seqs sequences, 64-token batches)
// and a batch, both freed when the test ends.
func testContext(t testing.TB, m *Model, cells, seqs int) (*Context, *Batch) {
	t.Helper()
	c, err := NewContext(m, ContextParams{Cells: cells, Sequences: seqs, Batch: 64, Threads: 2, Unified: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	b := NewBatch(64)
	t.Cleanup(b.Free)
	return c, b
}

// LoadModel reports its progress up to the whole model.
func TestLoadProgress(t *testing.T) {
	var got []float32
	m, err := LoadModel(testenv.Model(t), ModelParams{Progress: func(f float32) { got = append(got, f) }})
	if err != nil {
		t.Fatal(err)
	}
	m.Close()
	if len(got) == 0 || got[len(got)-1] != 1 {
		t.Fatalf("progress %v, want steps ending at 1", got)
	}
	for i := 1; i < len(got); i++ {
		if got[i] < got[i-1] {
			t.Fatalf("progress went back: %v", got)
		}
	}
}

func TestTokenizeRoundTrip(t *testing.T) {
	m := testModel(t)
	for _, text := range []string{"the quick river", "café über 日本", "x\ny", "<|im_start|>"} {
		toks, err := m.Tokenize(text, false, false)
		if err != nil {
			t.Fatal(err)
		}
		var b strings.Builder
		for _, tok := range toks {
			b.Write(m.Piece(tok))
		}
		// SentencePiece adds a leading space marker to the text.
		if got := strings.TrimPrefix(b.String(), " "); got != text {
			t.Errorf("pieces of Tokenize(%q) = %q, want %q", text, got, text)
		}
	}
	toks, _ := m.Tokenize("the river", false, false)
	if len(toks) != 2 {
		t.Errorf("Tokenize(%q) = %v, want one token a word", "the river", toks)
	}
	special, _ := m.Tokenize("<|im_end|>", false, true)
	if len(special) != 1 || !m.IsEOG(special[0]) {
		t.Errorf("Tokenize(<|im_end|>, parseSpecial) = %v, want one end-of-generation token", special)
	}
}

func TestChatTemplate(t *testing.T) {
	m := testModel(t)
	tmpl := m.ChatTemplate()
	if tmpl == "" {
		t.Fatal("default model has no chat template")
	}
	got, err := ApplyChatTemplate(tmpl, []Message{{"system", "be brief"}, {"user", "hi"}}, true)
	if err != nil {
		t.Fatal(err)
	}
	want := "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
	if got != want {
		t.Errorf("ApplyChatTemplate = %q, want %q", got, want)
	}
	if _, err := ApplyChatTemplate("{{ no known markers }}", []Message{{"user", "hi"}}, true); err == nil {
		t.Error("ApplyChatTemplate accepted a template llama.cpp does not know")
	}
}

// TestContextLayout guards the shim's use of llama_context_params: kv_unified must give
// every sequence the whole pool, and its absence an equal share.
func TestContextLayout(t *testing.T) {
	m := testModel(t)
	for _, unified := range []bool{true, false} {
		c, err := NewContext(m, ContextParams{Cells: 1024, Sequences: 4, Batch: 64, Threads: 2, Unified: unified})
		if err != nil {
			t.Fatal(err)
		}
		want := 1024
		if !unified {
			want = 256
		}
		if c.Cells() != 1024 || c.SeqCells() != want || c.Sequences() != 4 {
			t.Errorf("unified=%v: cells %d, per sequence %d, sequences %d; want 1024, %d, 4", unified, c.Cells(), c.SeqCells(), c.Sequences(), want)
		}
		c.Close()
		c.Close()
	}
}

// TestFlashAttnLayout guards ContextParams.FlashAttn: without flash attention llama.cpp
// stores V transposed, so a sequence's state goes into a context of the same setting and
// is refused by one of the other.
func TestFlashAttnLayout(t *testing.T) {
	m := testModel(t)
	ctx := func(flash bool) *Context {
		c, err := NewContext(m, ContextParams{Cells: 256, Sequences: 1, Batch: 64, Threads: 1, Unified: true, FlashAttn: flash})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(c.Close)
		return c
	}
	b := NewBatch(64)
	defer b.Free()
	for _, flash := range []bool{true, false} {
		from := ctx(flash)
		b.Clear()
		for i := range 16 {
			b.Add(int32(i+1), i, 0, i == 15)
		}
		if err := from.Decode(b); err != nil {
			t.Fatal(err)
		}
		state, err := from.SeqState(0, nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := ctx(flash).SetSeqState(0, state); err != nil {
			t.Errorf("flash=%v: a state into a context of the same setting: %v", flash, err)
		}
		if err := ctx(!flash).SetSeqState(0, state); err == nil {
			t.Errorf("flash=%v: a state went into a context with flash=%v (the V layouts differ)", flash, !flash)
		}
	}
}

// Decode's answer comes back from the decoding thread: a full cache is ErrNoKVSlot, and
// the thread decodes again once there is room.
func TestDecodeNoSlot(t *testing.T) {
	c, b := testContext(t, testModel(t), 256, 1)
	fill := func(from int) error {
		b.Clear()
		for i := range 64 {
			b.Add(1, from+i, 0, i == 63)
		}
		return c.Decode(b)
	}
	pos := 0
	for ; pos < c.Cells(); pos += 64 {
		if err := fill(pos); err != nil {
			t.Fatalf("decode at %d of %d cells: %v", pos, c.Cells(), err)
		}
	}
	if err := fill(pos); !errors.Is(err, ErrNoKVSlot) {
		t.Fatalf("decode into a full cache: %v, want ErrNoKVSlot", err)
	}
	c.SeqRemove(0, pos-64, -1)
	if err := fill(pos - 64); err != nil {
		t.Fatalf("decode after freeing 64 cells: %v", err)
	}
}

func TestDecodeGreedy(t *testing.T) {
	m := testModel(t)
	c, b := testContext(t, m, 512, 2)
	s := must(NewSampler(m, SamplerParams{Temperature: 0}))
	defer s.Free()

	prompt, _ := m.Tokenize("the river and the sea", true, false)
	toks, _ := greedy(t, m, c, b, s, prompt, 1, 8)
	var out []byte
	for _, tok := range toks {
		out = append(out, m.Piece(tok)...)
	}
	t.Logf("generated %q", out)
	if len(strings.Fields(string(out))) < 4 {
		t.Errorf("generated %q, want words", out)
	}
	if got, want := c.SeqPosMax(1), len(prompt)+6; got != want {
		t.Errorf("SeqPosMax(1) = %d, want %d", got, want)
	}
	if got := c.SeqPosMax(0); got != -1 {
		t.Errorf("SeqPosMax(0) = %d, want -1 (unused sequence)", got)
	}
	c.SeqRemove(1, 3, -1)
	if got := c.SeqPosMax(1); got != 2 {
		t.Errorf("after SeqRemove(1, 3, -1): SeqPosMax(1) = %d, want 2", got)
	}
}

// greedy decodes prompt in sequence seq and samples n tokens with s, one a step; it
// returns them and the logits of the first.
func greedy(t *testing.T, m *Model, c *Context, b *Batch, s *Sampler, prompt []int32, seq, n int) ([]int32, []float32) {
	t.Helper()
	var idx int
	for i, tok := range prompt {
		idx = b.Add(tok, i, seq, i == len(prompt)-1)
	}
	var first []float32
	var out []int32
	for pos := len(prompt); pos < len(prompt)+n; pos++ {
		if err := c.Decode(b); err != nil {
			t.Fatal(err)
		}
		if first == nil {
			first = slices.Clone(c.Logits(idx).Row(m.NumVocab()))
		}
		tok := s.Sample(c.Logits(idx))
		out = append(out, tok)
		b.Clear()
		idx = b.Add(tok, pos, seq, true)
	}
	return out, first
}

// TestAttentionBesideOthers: a sequence's logits are the same alone and in a unified pool
// where runs of other sequences' cells lie between its own, with flash attention and
// without. The mask hides the others' cells; the patched kernel (scripts/ggml-fattn-skip.patch)
// passes masked runs 16 cells at a time and must neither count one of them nor skip one of
// the sequence's own. The runs are 5 to 33 cells long: a step of 16 from the first cell of
// the shortest would pass 8 of the sequence's own.
func TestAttentionBesideOthers(t *testing.T) {
	m := testModel(t)
	const chunk = 8
	others := []int{5, 20, 33, 17}
	tok := func(i int) int32 { return int32(10 + i%(m.NumVocab()-10)) }
	for _, flash := range []bool{true, false} {
		logits := func(beside bool) []float32 {
			c, err := NewContext(m, ContextParams{Cells: 512, Sequences: 1 + len(others), Batch: 64, Threads: 2, Unified: true, FlashAttn: flash})
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			b := NewBatch(64)
			defer b.Free()
			var idx int
			for k := 0; k <= len(others); k++ {
				b.Clear()
				for i := range chunk {
					pos := k*chunk + i
					idx = b.Add(tok(pos), pos, 0, k == len(others) && i == chunk-1)
				}
				if err := c.Decode(b); err != nil {
					t.Fatal(err)
				}
				if !beside || k == len(others) {
					continue
				}
				b.Clear()
				for i := range others[k] {
					b.Add(tok(1000+100*k+i), i, 1+k, false)
				}
				if err := c.Decode(b); err != nil {
					t.Fatal(err)
				}
			}
			return slices.Clone(c.Logits(idx).Row(m.NumVocab()))
		}
		alone, beside := logits(false), logits(true)
		var worst float64
		for i := range alone {
			worst = max(worst, math.Abs(float64(alone[i]-beside[i])))
		}
		// Flash attention passes masked cells and sums the rest in cell order: bit for bit.
		// Without it the softmax sums rows of another length (more masked cells) in other
		// SIMD lanes: measured up to 8e-4.
		if tol := map[bool]float64{true: 0, false: 1e-2}[flash]; worst > tol {
			t.Errorf("flash=%v: logits beside other sequences differ from alone by up to %g, want at most %g", flash, worst, tol)
		}
	}
}

// TestMMap: the weights read into memory and the file mapped give the same logits, bit
// for bit, and so the same greedy text.
func TestMMap(t *testing.T) {
	run := func(mmap bool) ([]float32, []int32) {
		m, err := LoadModel(testenv.Model(t), ModelParams{MMap: mmap})
		if err != nil {
			t.Fatal(err)
		}
		defer m.Close()
		c, b := testContext(t, m, 512, 1)
		s := must(NewSampler(m, SamplerParams{Temperature: 0}))
		defer s.Free()
		prompt, _ := m.Tokenize("the river and the sea", true, false)
		out, first := greedy(t, m, c, b, s, prompt, 0, 16)
		return first, out
	}
	readLogits, readText := run(false)
	mappedLogits, mappedText := run(true)
	if !slices.Equal(readLogits, mappedLogits) || !slices.Equal(readText, mappedText) {
		t.Errorf("read into memory and mapped differ: tokens %v against %v", readText, mappedText)
	}
}

// TestQuantize: llama.cpp's quantizer writes the default model in Q8_0, Q4_0 and Q4_K_M,
// the loader reads them as such, and their next-token logits follow the F32 model's: the
// error through the whole network leaves them closely correlated (4 bits err more than
// 8). An unknown type is refused and writes nothing.
func TestQuantize(t *testing.T) {
	src := testenv.Model(t)
	logits := func(path string) ([]float32, string) {
		m, err := LoadModel(path, ModelParams{})
		if err != nil {
			t.Fatal(err)
		}
		defer m.Close()
		c, err := NewContext(m, ContextParams{Cells: 256, Sequences: 1, Batch: 64, Threads: 2, Unified: true})
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		b := NewBatch(64)
		defer b.Free()
		prompt, _ := m.Tokenize("the river and the old mill by the sea", true, false)
		var idx int
		for i, tok := range prompt {
			idx = b.Add(tok, i, 0, i == len(prompt)-1)
		}
		if err := c.Decode(b); err != nil {
			t.Fatal(err)
		}
		return slices.Clone(c.Logits(idx).Row(m.NumVocab())), m.Description()
	}
	ref, desc := logits(src)
	t.Logf("source: %s", desc)
	dir := t.TempDir()
	for _, c := range []struct {
		kind, desc string
		least      float64 // correlation of the logits with F32's
	}{{"q8_0", "Q8_0", 0.999}, {"q4_0", "Q4_0", 0.95}, {"q4_k_m", "Q4_K - Medium", 0.98}} {
		out := filepath.Join(dir, c.kind+".gguf")
		if err := Quantize(src, out, c.kind, 2); err != nil {
			t.Fatal(err)
		}
		got, desc := logits(out)
		if !strings.Contains(desc, c.desc) {
			t.Errorf("%s: llama.cpp describes the model as %q", c.kind, desc)
		}
		r := correlation(ref, got)
		t.Logf("%s: %s; correlation with F32's logits %.5f", c.kind, desc, r)
		if r < c.least {
			t.Errorf("%s: logits correlate %.5f with F32's, want at least %.3f", c.kind, r, c.least)
		}
	}
	out := filepath.Join(dir, "q3.gguf")
	if err := Quantize(src, out, "q3", 2); err == nil || !strings.Contains(err.Error(), "q4_k_m") {
		t.Errorf("Quantize to q3: %v, want an error that lists the types", err)
	}
	if _, err := os.Stat(out); !os.IsNotExist(err) {
		t.Errorf("Quantize to q3 left %s (%v)", out, err)
	}
}

// correlation is Pearson's correlation of x and y.
func correlation(x, y []float32) float64 {
	var mx, my float64
	for i := range x {
		mx += float64(x[i])
		my += float64(y[i])
	}
	mx /= float64(len(x))
	my /= float64(len(y))
	var sxy, sxx, syy float64
	for i := range x {
		dx, dy := float64(x[i])-mx, float64(y[i])-my
		sxy += dx * dy
		sxx += dx * dx
		syy += dy * dy
	}
	return sxy / math.Sqrt(sxx*syy)
}

// must is a sampler built without a grammar, which cannot fail.
func must(s *Sampler, err error) *Sampler {
	if err != nil {
		panic(err)
	}
	return s
}

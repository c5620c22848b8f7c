package llama

import (
	"strings"
	"testing"

	"github.com/infernode/infernode/internal/testenv"
)

// testModel loads the model named by INFERNODE_TEST_MODEL (make test sets it to the default
// model) or skips.
func testModel(t *testing.T) *Model {
	t.Helper()
	path := testenv.Model(t)
	m, err := LoadModel(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(m.Close)
	return m
}

// LoadModel reports its progress up to the whole model.
func TestLoadProgress(t *testing.T) {
	var got []float32
	m, err := LoadModel(testenv.Model(t), func(f float32) { got = append(got, f) })
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

func TestDecodeGreedy(t *testing.T) {
	m := testModel(t)
	c, err := NewContext(m, ContextParams{Cells: 512, Sequences: 2, Batch: 64, Threads: 2, Unified: true})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	b := NewBatch(64)
	defer b.Free()
	s := NewSampler(m, SamplerParams{Temperature: 0})
	defer s.Free()

	prompt, _ := m.Tokenize("the river and the sea", true, false)
	var idx int
	for i, tok := range prompt {
		idx = b.Add(tok, i, 1, i == len(prompt)-1)
	}
	var out []byte
	for pos := len(prompt); pos < len(prompt)+8; pos++ {
		if err := c.Decode(b); err != nil {
			t.Fatal(err)
		}
		tok := s.Sample(c.Logits(idx))
		out = append(out, m.Piece(tok)...)
		b.Clear()
		idx = b.Add(tok, pos, 1, true)
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

package session

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/infernode/infernode/session/infer"
	"github.com/infernode/infernode/session/llama"
)

// fakeBackend stands in for a model and its context, deterministically: a word is a
// token, and the token after tok at position pos is always nextToken(tok, pos), so the
// answer to any prompt is known without the engine, however the engine batched, shared or
// resumed it. It refuses what llama.cpp would get wrong silently: a token at a position
// other than its sequence's next, a sequence longer than SeqCells. Each Decode takes
// perToken a token of (under synctest, virtual) time.
type fakeBackend struct {
	cells, seqCells int
	seqIDs          int // the sequence ids the context has: 0..seqIDs-1 (0: any)
	perToken        time.Duration

	mu      sync.Mutex
	seqs    map[int][]int32 // each sequence's tokens, at positions 0..n-1
	rows    map[int]int32   // the last Decode's next token, by batch index
	decodes int
	maxRows int   // the most rows of logits one Decode produced
	fail    error // the next Decode fails with it
	// scattered counts the Decodes of one token a sequence that llama.cpp would split
	// into more than one pass over the weights (see passes): partitions only.
	scattered int
}

const (
	fakeVocab = 512
	fakeBOS   = 1
	fakeEOG   = 2
)

func newFakeBackend(cells, seqCells int, perToken time.Duration) *fakeBackend {
	return &fakeBackend{cells: cells, seqCells: seqCells, perToken: perToken, seqs: map[int][]int32{}, rows: map[int]int32{}}
}

// wordToken is a word's token: N for "tN" (a piece's text, so that text the engine
// generated tokenizes back to its tokens), else 3..fakeVocab-1 by its hash.
func wordToken(w string) int32 {
	if n, err := strconv.Atoi(strings.TrimPrefix(w, "t")); err == nil && strings.HasPrefix(w, "t") && n >= 3 && n < fakeVocab {
		return int32(n)
	}
	h := fnv.New32a()
	h.Write([]byte(w))
	return 3 + int32(h.Sum32()%(fakeVocab-3))
}

// nextToken is what the fake model says after tok at position pos.
func nextToken(tok int32, pos int) int32 { return 3 + (tok*31+int32(pos)*7)%(fakeVocab-3) }

func (f *fakeBackend) NumVocab() int        { return fakeVocab }
func (f *fakeBackend) TrainedContext() int  { return 0 }
func (f *fakeBackend) ChatTemplate() string { return "" }
func (f *fakeBackend) Tokenize(text string, addSpecial, _ bool) ([]int32, error) {
	var out []int32
	if addSpecial {
		out = append(out, fakeBOS)
	}
	for _, w := range strings.Fields(text) {
		out = append(out, wordToken(w))
	}
	return out, nil
}
func (f *fakeBackend) Piece(tok int32) []byte   { return fmt.Appendf(nil, " t%d", tok) }
func (f *fakeBackend) IsEOG(tok int32) bool     { return tok == fakeEOG }
func (f *fakeBackend) IsControl(tok int32) bool { return tok < 3 }
func (f *fakeBackend) Cells() int               { return f.cells }
func (f *fakeBackend) SeqCells() int            { return f.seqCells }

func (f *fakeBackend) Decode(b *Batch) error {
	f.mu.Lock()
	f.decodes++
	if err := f.fail; err != nil {
		f.fail = nil
		f.mu.Unlock()
		return err
	}
	clear(f.rows)
	for i, tok := range b.Tokens {
		seq, pos := b.Seq[i], b.Pos[i]
		f.checkSeq(seq)
		if pos != len(f.seqs[seq]) || pos >= f.seqCells {
			f.mu.Unlock()
			return fmt.Errorf("fake: token %d of sequence %d at position %d, its next is %d (of %d)", i, seq, pos, len(f.seqs[seq]), f.seqCells)
		}
		f.seqs[seq] = append(f.seqs[seq], tok)
		if b.Logits[i] {
			f.rows[i] = nextToken(tok, pos)
		}
	}
	f.maxRows = max(f.maxRows, len(f.rows))
	if f.seqIDs > 0 && f.seqCells < f.cells && passes(b.Seq) > 1 && len(slices.Compact(slices.Sorted(slices.Values(b.Seq)))) == len(b.Seq) {
		f.scattered++
	}
	f.mu.Unlock()
	time.Sleep(time.Duration(b.Len()) * f.perToken)
	return nil
}

// passes is how many micro-batches llama.cpp splits a batch over partitions into
// (llama_batch_allocr::split_equal, sequential, as llama_kv_cache::init_batch asks with
// more than one stream), each a pass over the weights: from the first token not yet
// taken, the sequences of consecutive ids that follow it in the batch, an equal number
// of tokens from each.
func passes(seqs []int) int {
	left := map[int]int{}
	for _, s := range seqs {
		left[s]++
	}
	used := make([]bool, len(seqs))
	n := 0
	for slices.Contains(used, false) {
		var set []int
		for i, s := range seqs {
			if !used[i] && !slices.Contains(set, s) && (len(set) == 0 || s == set[len(set)-1]+1) {
				set = append(set, s)
			}
		}
		take := len(seqs)
		for _, s := range set {
			take = min(take, left[s])
		}
		for _, s := range set {
			k := take
			for i := range seqs {
				if k > 0 && !used[i] && seqs[i] == s {
					used[i], k = true, k-1
				}
			}
			left[s] -= take
		}
		n++
	}
	return n
}

// checkSeq panics on a sequence id the context does not have: llama.cpp reads -1 as every
// sequence, and asserts on ids past its last.
func (f *fakeBackend) checkSeq(seqs ...int) {
	for _, seq := range seqs {
		if seq < 0 || f.seqIDs > 0 && seq >= f.seqIDs {
			panic(fmt.Sprintf("fake: sequence id %d, the context has %d", seq, f.seqIDs))
		}
	}
}

func (f *fakeBackend) Logits(i int) []float32 {
	f.mu.Lock()
	defer f.mu.Unlock()
	row := make([]float32, fakeVocab)
	row[f.rows[i]] = 1
	return row
}

func (f *fakeBackend) SeqRemove(seq, from, to int) bool {
	f.checkSeq(seq)
	f.mu.Lock()
	defer f.mu.Unlock()
	s := f.seqs[seq]
	if to < 0 || to > len(s) {
		to = len(s)
	}
	if from < to {
		f.seqs[seq] = append(s[:from:from], s[to:]...)
	}
	return true
}

func (f *fakeBackend) SeqCopy(src, dst, n int) {
	f.checkSeq(src, dst)
	f.mu.Lock()
	defer f.mu.Unlock()
	f.seqs[dst] = append([]int32(nil), f.seqs[src][:n]...)
}

func (f *fakeBackend) SeqPosMax(seq int) int {
	f.checkSeq(seq)
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.seqs[seq]) - 1
}

func (f *fakeBackend) Clear() {
	f.mu.Lock()
	defer f.mu.Unlock()
	clear(f.seqs)
}

func (f *fakeBackend) SeqState(seq int, buf []byte) ([]byte, error) {
	f.checkSeq(seq)
	f.mu.Lock()
	defer f.mu.Unlock()
	out := buf[:0]
	for _, t := range f.seqs[seq] {
		out = binary.LittleEndian.AppendUint32(out, uint32(t))
	}
	return out, nil
}

func (f *fakeBackend) SetSeqState(seq int, state []byte) error {
	f.checkSeq(seq)
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(state)%4 != 0 {
		return errors.New("fake: bad state")
	}
	var toks []int32
	for i := 0; i < len(state); i += 4 {
		toks = append(toks, int32(binary.LittleEndian.Uint32(state[i:])))
	}
	f.seqs[seq] = toks
	return nil
}

func (f *fakeBackend) NewSampler(llama.SamplerParams) (Sampler, error) { return argmax{}, nil }
func (f *fakeBackend) Close()                                          {}

// argmax samples greedily, whatever the parameters.
type argmax struct{}

func (argmax) Accept(int32)         {}
func (argmax) Follow([]int32) error { return nil }
func (argmax) Free()                {}
func (argmax) Sample(row []float32) int32 {
	best := 0
	for i, v := range row {
		if v > row[best] {
			best = i
		}
	}
	return int32(best)
}

// answer is the fake model's greedy answer of n tokens to prompt.
func answer(prompt string, n int) string {
	toks, _ := (&fakeBackend{}).Tokenize(prompt, true, false)
	var b strings.Builder
	tok, pos := toks[len(toks)-1], len(toks)-1
	for range n {
		tok = nextToken(tok, pos)
		pos++
		fmt.Fprintf(&b, " t%d", tok)
	}
	return b.String()
}

// startFake runs an engine on a fake backend until the returned stop is called. Call it
// inside a synctest bubble: the fake's time is then virtual.
func startFake(t *testing.T, edit func(*Config)) (*Engine, *fakeBackend, func()) {
	cfg := DefaultConfig()
	cfg.ModelPath, cfg.Fingerprint, cfg.Seed, cfg.Threads = "fake", "fake", 1, 1
	cfg.Cells, cfg.Sequences = 1024, 4
	if edit != nil {
		edit(&cfg)
	}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	b := newFakeBackend(cfg.Cells, cfg.Cells, time.Millisecond)
	b.seqIDs = cfg.seqIDs()
	if !cfg.UnifiedKV {
		b.seqCells = cfg.Cells / cfg.Sequences
	}
	e := newEngine(cfg, b, slog.New(slog.NewTextHandler(io.Discard, nil)))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx) }()
	for !e.Ready() { // warm-up decodes a token: virtual time
		time.Sleep(time.Millisecond)
	}
	return e, b, func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
		e.Close()
	}
}

// ask submits a greedy request and collects its answer.
func ask(t *testing.T, e *Engine, key, prompt string, n int) (string, infer.Result, int) {
	t.Helper()
	return submit(t, e, infer.Request{SessionID: key, Prompt: prompt, MaxTokens: n, Sampling: infer.Greedy()})
}

// submit submits req and collects its answer, with the tokens it found cached.
func submit(t *testing.T, e *Engine, req infer.Request) (string, infer.Result, int) {
	t.Helper()
	st, err := e.Submit(t.Context(), req)
	if err != nil {
		t.Fatalf("Submit %q: %v", req.Prompt, err)
	}
	text, res, err := st.Collect()
	if err != nil {
		t.Fatalf("%q: %v", req.Prompt, err)
	}
	_, cached, _ := st.Admitted()
	return text, res, cached
}

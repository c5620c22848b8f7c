package session

import "github.com/infernode/infernode/session/llama"

// Backend is what the engine needs of a model and the context it runs in: its vocabulary,
// decoding a batch, sampling, and operations on a sequence's KV cells. The engine calls it
// from its own goroutine only (Sampler.Sample excepted: different Samplers may sample at
// once). llamaBackend is llama.cpp's; the scheduler's tests use a deterministic fake, so
// placement, sharing, admission and timeouts are tested without a model.
type Backend interface {
	// NumVocab is the vocabulary's size: the length of a row of logits.
	NumVocab() int
	// TrainedContext is the context the model was trained for (0: unknown).
	TrainedContext() int
	// ChatTemplate is the model's chat template ("" when it has none).
	ChatTemplate() string
	// Tokenize turns text into tokens, with the model's BOS when addSpecial, and control
	// tokens spelled in text parsed as such only when parseSpecial.
	Tokenize(text string, addSpecial, parseSpecial bool) ([]int32, error)
	// Piece is a token's text (possibly part of a UTF-8 sequence).
	Piece(tok int32) []byte
	IsEOG(tok int32) bool
	IsControl(tok int32) bool

	// Cells is the KV cache's size in cells (tokens); SeqCells how many one sequence may
	// use.
	Cells() int
	SeqCells() int
	// Decode runs a batch: each token extends its sequence at its position. Logits is the
	// output row of the batch's i-th token (one that asked for it), valid until the next
	// Decode.
	Decode(b *Batch) error
	Logits(i int) []float32
	// SeqRemove removes a sequence's cells at positions [from, to) (to -1: to the end);
	// SeqCopy makes the first n cells of src dst's too; SeqPosMax is a sequence's last
	// position (-1 when empty); Clear empties every sequence.
	SeqRemove(seq, from, to int) bool
	SeqCopy(src, dst, n int)
	SeqPosMax(seq int) int
	Clear()
	// SeqState copies a sequence's state out (into buf when it is large enough);
	// SetSeqState installs one into a sequence.
	SeqState(seq int, buf []byte) ([]byte, error)
	SetSeqState(seq int, state []byte) error
	// NewSampler makes a sampler for one request (an error: its grammar does not parse).
	NewSampler(p llama.SamplerParams) (Sampler, error)
	// Close frees the model and context.
	Close()
}

// Sampler picks a request's tokens from rows of logits, keeping its own history.
type Sampler interface {
	// Accept feeds a token the sampler did not choose (a prompt token) into its history.
	Accept(tok int32)
	// Sample picks the next token from a row of logits and records it; -1 when a
	// grammar allows no token.
	Sample(row []float32) int32
	// Follow advances the grammar, if any, over tokens of the answer generated elsewhere.
	Follow(tokens []int32) error
	Free()
}

// Batch is the tokens of one decode step, each with its position and sequence, and
// whether its logits are wanted.
type Batch struct {
	Tokens []int32
	Pos    []int
	Seq    []int
	Logits []bool
	cap    int
}

// NewBatch makes a batch of up to n tokens.
func NewBatch(n int) *Batch {
	return &Batch{Tokens: make([]int32, 0, n), Pos: make([]int, 0, n), Seq: make([]int, 0, n), Logits: make([]bool, 0, n), cap: n}
}

// Add appends a token at position pos of sequence seq and returns its index, by which
// Backend.Logits reads its row when logits is set.
func (b *Batch) Add(tok int32, pos, seq int, logits bool) int {
	if len(b.Tokens) >= b.cap {
		panic("session: batch overflow") // a bug in the step's budget, never input-driven
	}
	b.Tokens, b.Pos, b.Seq, b.Logits = append(b.Tokens, tok), append(b.Pos, pos), append(b.Seq, seq), append(b.Logits, logits)
	return len(b.Tokens) - 1
}

// Len is the number of tokens in the batch; Cap the most it holds.
func (b *Batch) Len() int { return len(b.Tokens) }
func (b *Batch) Cap() int { return b.cap }

// Clear empties the batch.
func (b *Batch) Clear() {
	b.Tokens, b.Pos, b.Seq, b.Logits = b.Tokens[:0], b.Pos[:0], b.Seq[:0], b.Logits[:0]
}

// llamaBackend is llama.cpp's model and context through session/llama.
type llamaBackend struct {
	model *llama.Model
	ctx   *llama.Context
	batch *llama.Batch
	vocab int
}

func loadLlama(cfg Config) (*llamaBackend, error) {
	model, err := llama.LoadModel(cfg.ModelPath, llama.ModelParams{MMap: cfg.MMap, Progress: cfg.LoadProgress})
	if err != nil {
		return nil, err
	}
	ctx, err := llama.NewContext(model, llama.ContextParams{
		Cells: cfg.Cells, Sequences: cfg.seqIDs(), Batch: cfg.BatchSize, Threads: cfg.Threads,
		Unified: cfg.UnifiedKV, KVType: cfg.KVType, FlashAttn: cfg.FlashAttn,
	})
	if err != nil {
		model.Close()
		return nil, err
	}
	return &llamaBackend{model: model, ctx: ctx, batch: llama.NewBatch(cfg.BatchSize), vocab: model.NumVocab()}, nil
}

func (l *llamaBackend) NumVocab() int        { return l.vocab }
func (l *llamaBackend) TrainedContext() int  { return l.model.TrainedContext() }
func (l *llamaBackend) ChatTemplate() string { return l.model.ChatTemplate() }
func (l *llamaBackend) Tokenize(text string, addSpecial, parseSpecial bool) ([]int32, error) {
	return l.model.Tokenize(text, addSpecial, parseSpecial)
}
func (l *llamaBackend) Piece(tok int32) []byte           { return l.model.Piece(tok) }
func (l *llamaBackend) IsEOG(tok int32) bool             { return l.model.IsEOG(tok) }
func (l *llamaBackend) IsControl(tok int32) bool         { return l.model.IsControl(tok) }
func (l *llamaBackend) Cells() int                       { return l.ctx.Cells() }
func (l *llamaBackend) SeqCells() int                    { return l.ctx.SeqCells() }
func (l *llamaBackend) Logits(i int) []float32           { return l.ctx.Logits(i).Row(l.vocab) }
func (l *llamaBackend) SeqRemove(seq, from, to int) bool { return l.ctx.SeqRemove(seq, from, to) }
func (l *llamaBackend) SeqCopy(src, dst, n int)          { l.ctx.SeqCopy(src, dst, n) }
func (l *llamaBackend) SeqPosMax(seq int) int            { return l.ctx.SeqPosMax(seq) }
func (l *llamaBackend) Clear()                           { l.ctx.Clear() }
func (l *llamaBackend) SeqState(seq int, buf []byte) ([]byte, error) {
	return l.ctx.SeqState(seq, buf)
}
func (l *llamaBackend) SetSeqState(seq int, state []byte) error { return l.ctx.SetSeqState(seq, state) }

func (l *llamaBackend) Decode(b *Batch) error {
	l.batch.Clear()
	for i, tok := range b.Tokens {
		l.batch.Add(tok, b.Pos[i], b.Seq[i], b.Logits[i])
	}
	return l.ctx.Decode(l.batch)
}

func (l *llamaBackend) NewSampler(p llama.SamplerParams) (Sampler, error) {
	s, err := llama.NewSampler(l.model, p)
	if err != nil {
		return nil, err
	}
	return llamaSampler{s}, nil
}

func (l *llamaBackend) Close() {
	l.batch.Free()
	l.ctx.Close()
	l.model.Close()
}

type llamaSampler struct{ *llama.Sampler }

func (s llamaSampler) Sample(row []float32) int32 { return s.SampleRow(row) }

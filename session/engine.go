package session

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/infernode/infernode/session/infer"
	"github.com/infernode/infernode/session/llama"
)

// Engine runs one model on one llama.cpp context for many concurrent requests.
type Engine struct {
	cfg   Config
	log   *slog.Logger
	b     Backend // the model and its context
	batch *Batch
	rng   *rand.Rand // seeds for requests asking for a random one; engine goroutine only

	cells    int     // cells in the KV cache, as llama.cpp made it (it may round Config.Cells up)
	seqCells int     // cells one sequence may use
	share    int     // generated tokens a request claims cells for at admission: cells/sequences
	bos      []int32 // what tokenizing adds before every prompt (the model's BOS, if it wants one)
	maxPiece int     // the longest piece of the vocabulary, in bytes: bounds a prompt's bytes by its tokens
	// byteToken is a token whose piece is that one byte (-1: none), for a grammar to
	// follow text byte by byte.
	byteToken [256]int32

	mu      sync.Mutex
	waiting []*job      // FIFO, at most cfg.MaxQueue; guarded by mu
	running bool        // Run is in its loop; guarded by mu
	refused uint64      // requests refused at Submit; guarded by mu
	done    []time.Time // when the last drainWindow requests finished, oldest first; guarded by mu
	wake    chan struct{}
	tasks   chan func()   // run on the engine goroutine between steps (Export, Import)
	held    sync.Map      // key → a replica (bool): the conversations with KV here (see Holds, Owns)
	stopped chan struct{} // closed when Run returns

	// Engine-goroutine state.
	slots   []*slot
	jobs    []*job // admitted, in admission order
	parked  []*job // batch requests preempted for interactive work, KV copied out; oldest first
	tick    uint64 // step counter, the LRU clock
	stalled int    // running requests the last step left waiting for cells to grow into
	// hostTokens is the tokens of the conversations whose cells are in host memory (see
	// stash), at most hostCells, in hostBytes; spare holds buffers of restored ones for
	// the next (spareBytes of room), and cellBytes is the most a token's state has taken.
	hostTokens int
	hostCells  int
	hostBytes  int
	spare      [][]byte
	spareBytes int
	cellBytes  int

	stats     atomic.Pointer[infer.Stats]
	ready     atomic.Bool
	closeOnce sync.Once
}

// slot is a conversation's place in the engine: its cached tokens, whose KV occupies cells
// at positions 0..len(tokens)-1 of llama.cpp sequence seq (or lies in host memory).
type slot struct {
	seq      int    // its own in a unified pool; a partition's, or -1 for none, without (see seqFor)
	key      string // conversation id; "" when anonymous
	tokens   []int32
	job      *job // running request, or nil when idle
	lastUsed uint64
	replica  bool         // imported as another node's copy: evicted first, until a turn runs here
	origin   infer.Origin // how its cells came here (Local once a turn ran here)
	share    string       // the prefix-sharing domain of the conversation (see infer.Request.Share)
	// host is the sequence's state while its cells are out of the pool (see stash): its
	// tokens are still this conversation's, its cells in llama.cpp free.
	host []byte
}

// job is an accepted request as the engine tracks it.
type job struct {
	ctx       context.Context
	req       infer.Request
	prompt    []int32
	maxTokens int
	stream    *Stream
	submitted time.Time
	grammar   string  // req.Schema's
	answered  []int32 // req.Answered, a token a byte: the grammar follows it first

	// Set at admission.
	slot     *slot
	sampler  Sampler
	filter   *textFilter
	admitted time.Time
	since    uint64 // the step counter at admission
	cached   int
	pending  []int32   // tokens to feed: the rest of the prompt, then the last sampled token
	logitIdx int       // batch index of this job's logits in the current step, or -1
	logits   []float32 // that row, once decoded
	next     int32     // the token sampled from it
	fed      int       // tokens of pending in the current step's batch
	claim    int       // KV cells it holds in a unified pool's accounting (see room)
	first    time.Time
	gen      int
	logprobs []infer.TokenLogprob // when the request asked for them
	out      int                  // bytes of the generated tokens' pieces so far
	scored   []int                // batch indexes of this step's prompt tokens whose logits score the next (PromptLogprobs)
	prompted []infer.TokenLogprob // the prompt's tokens scored so far (PromptLogprobs)

	// Set while preempted (see preempt): the slot's KV state and tokens, to install
	// into another slot when the request resumes.
	parkedState  []byte
	parkedTokens []int32
}

// New loads the model and creates the context. It starts nothing: Run does the work.
func New(cfg Config) (*Engine, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("session config: %w", err)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	log = log.With("component", "session")
	if cfg.Fingerprint == "" {
		var err error
		if cfg.Fingerprint, err = Fingerprint(cfg); err != nil {
			return nil, err
		}
	}
	b, err := loadLlama(cfg)
	if err != nil {
		return nil, err
	}
	log.Info("model loaded", "model", cfg.ModelPath, "desc", b.model.Description())
	return newEngine(cfg, b, log), nil
}

// newEngine builds an engine on a backend (llama.cpp's, or a test's fake).
func newEngine(cfg Config, b Backend, log *slog.Logger) *Engine {
	seed := cfg.Seed
	if seed == 0 {
		seed = uint64(time.Now().UnixNano())
	}
	bos, _ := b.Tokenize("", true, false) // nothing when the tokenizer fails: warm falls back to token 0
	maxPiece := 1
	var byteToken [256]int32
	for i := range byteToken {
		byteToken[i] = -1
	}
	for tok := range b.NumVocab() {
		piece := b.Piece(int32(tok))
		maxPiece = max(maxPiece, len(piece))
		if len(piece) == 1 && byteToken[piece[0]] < 0 && !b.IsControl(int32(tok)) {
			byteToken[piece[0]] = int32(tok)
		}
	}
	e := &Engine{
		cfg: cfg, log: log, b: b, bos: bos, maxPiece: maxPiece, byteToken: byteToken,
		batch:     NewBatch(cfg.BatchSize),
		rng:       rand.New(rand.NewPCG(seed, seed>>32|1)),
		cells:     b.Cells(),
		seqCells:  seqContext(cfg.SeqContext, b.TrainedContext(), b.SeqCells(), log),
		share:     b.Cells() / cfg.Sequences,
		hostCells: cmp.Or(cfg.HostCells, b.Cells()),
		wake:      make(chan struct{}, 1),
		tasks:     make(chan func()),
		stopped:   make(chan struct{}),
	}
	for i := range cfg.conversations() {
		seq := i
		if i >= cfg.seqIDs() {
			seq = -1 // a partition comes when it runs (see seqFor)
		}
		e.slots = append(e.slots, &slot{seq: seq})
	}
	e.publishStats(&infer.Stats{})
	log.Info("engine created", "cells", e.cells, "seq_cells", e.seqCells, "sequences", cfg.Sequences,
		"conversations", len(e.slots), "batch", cfg.BatchSize, "threads", cfg.Threads, "unified_kv", cfg.UnifiedKV, "flash_attn", cfg.FlashAttn, "seed", seed)
	return e
}

// seqContext is the most tokens one conversation may hold (see Config.SeqContext): asked
// for, else the model's trained context, and at most what one sequence has of the pool.
func seqContext(asked, trained, pool int, log *slog.Logger) int {
	switch {
	case asked > pool:
		log.Warn("context per conversation asked for is more than a sequence has of the KV pool: using the pool's",
			"asked", asked, "pool", pool)
		return pool
	case asked > 0:
		if trained > 0 && asked > trained {
			log.Warn("context per conversation is longer than the model was trained for: answers past it may degrade",
				"asked", asked, "trained", trained)
		}
		return asked
	case trained > 0 && trained < pool:
		log.Info("context per conversation is the model's trained context (--seq-ctx asks for more)",
			"trained", trained, "pool", pool)
		return trained
	}
	return pool
}

// Backend is the model and context the engine runs on, for tokenizing.
func (e *Engine) Backend() Backend { return e.b }

// SeqCells is the most tokens (prompt plus generated) one request can hold.
func (e *Engine) SeqCells() int { return e.seqCells }

// MaxPromptTokens is the longest prompt Submit accepts: Config.MaxPromptTokens, and always
// leaving a sequence room for one generated token.
func (e *Engine) MaxPromptTokens() int {
	limit := e.seqCells - 1
	if e.cfg.MaxPromptTokens > 0 {
		limit = min(limit, e.cfg.MaxPromptTokens)
	}
	return limit
}

// checkBytes refuses text longer in bytes than the longest prompt could spell, before it
// is tokenized.
func (e *Engine) checkBytes(text string) error {
	if limit := e.MaxPromptTokens(); len(text) > limit*e.maxPiece {
		return &infer.PromptTooLongError{Bytes: len(text), Limit: limit}
	}
	return nil
}

// Ready reports whether Run has warmed the model and is serving.
func (e *Engine) Ready() bool { return e.ready.Load() }

// Stats returns the latest snapshot.
func (e *Engine) Stats() infer.Stats {
	s := *e.stats.Load()
	e.mu.Lock()
	s.Waiting = len(e.waiting) + s.Parked
	s.Refused += e.refused
	e.mu.Unlock()
	return s
}

// Close frees the model and context. Call it after Run has returned; it is safe to call
// twice.
func (e *Engine) Close() {
	e.closeOnce.Do(e.b.Close)
}

// Submit validates and tokenizes a request and queues it. Errors it returns are final for
// this request: ErrInvalid (and ErrPromptTooLong) for bad input, ErrOverloaded when the
// queue is full, ErrClosed when the engine is not running. Otherwise the request's outcome
// arrives on the Stream, which always ends. Canceling ctx cancels the request.
func (e *Engine) Submit(ctx context.Context, req infer.Request) (*Stream, error) {
	if err := req.Validate(); err != nil {
		return nil, err
	}
	e.mu.Lock()
	full := len(e.waiting) >= e.queueFor(req)
	e.mu.Unlock()
	if full { // refuse before tokenizing: under overload, refusals must cost next to nothing
		return nil, e.refuse()
	}
	// A prompt longer in bytes than the longest prompt could spell is refused before it is
	// tokenized (which takes time and memory in proportion, three times over for text that
	// spells control tokens).
	if err := e.checkBytes(req.Prompt); err != nil {
		return nil, err
	}
	prompt, err := e.promptTokens(req)
	if err != nil {
		return nil, err
	}
	if err := e.inVocab("continue", req.Continue); err != nil {
		return nil, err
	}
	prompt = append(prompt, req.Continue...)
	if limit := e.MaxPromptTokens(); len(prompt) > limit {
		return nil, &infer.PromptTooLongError{Tokens: len(prompt), Limit: limit}
	}
	maxTokens := req.MaxTokens
	if maxTokens == 0 {
		maxTokens = e.cfg.DefaultMaxTokens
	}
	maxTokens = min(maxTokens, e.seqCells-len(prompt))
	grammar, answered, err := e.compileSchema(req)
	if err != nil {
		return nil, err
	}
	j := &job{ctx: ctx, req: req, prompt: prompt, maxTokens: maxTokens, stream: newStream(), submitted: time.Now(),
		grammar: grammar, answered: answered}

	e.mu.Lock()
	switch {
	case !e.running:
		e.mu.Unlock()
		return nil, infer.ErrClosed
	case len(e.waiting) >= e.queueFor(req):
		e.mu.Unlock()
		return nil, e.refuse()
	}
	e.waiting = append(e.waiting, j)
	e.mu.Unlock()
	e.signal()
	return j.stream, nil
}

// queueFor is how long the queue may be for req to join it: batch work gets half, so it
// is refused before any interactive request is.
func (e *Engine) queueFor(req infer.Request) int {
	if req.Batch {
		return max(1, e.cfg.MaxQueue/2)
	}
	return e.cfg.MaxQueue
}

// promptTokens is req's prompt as tokens: its Tokens, checked against the vocabulary, or
// its Prompt tokenized.
func (e *Engine) promptTokens(req infer.Request) ([]int32, error) {
	if len(req.Tokens) == 0 {
		prompt, err := e.tokenize(req.Prompt)
		if err != nil {
			return nil, fmt.Errorf("%w: %w", infer.ErrInvalid, err)
		}
		return prompt, nil
	}
	if err := e.inVocab("prompt", req.Tokens); err != nil {
		return nil, err
	}
	return slices.Clone(req.Tokens), nil
}

// inVocab refuses token ids outside the vocabulary (llama.cpp would read past its tables).
func (e *Engine) inVocab(param string, tokens []int32) error {
	vocab := int32(e.b.NumVocab())
	for i, t := range tokens {
		if t < 0 || t >= vocab {
			return &infer.InvalidError{Param: param, Reason: fmt.Sprintf("token %d (at %d) is not in the vocabulary of %d", t, i, vocab)}
		}
	}
	return nil
}

// compileSchema compiles req's schema to the grammar that enforces it and checks the text
// its answer had before it moved here against that grammar, returning the grammar and the
// text's tokens (the request's sampler follows them at admission). A schema llama.cpp
// cannot compile, or an answer so far that does not match it, is refused before the
// request is queued.
func (e *Engine) compileSchema(req infer.Request) (string, []int32, error) {
	if req.Schema == "" {
		return "", nil, nil
	}
	grammar := llama.SchemaToGrammar([]byte(req.Schema))
	if grammar == "" {
		return "", nil, &infer.InvalidError{Param: "response_format", Reason: "the JSON schema could not be compiled to a grammar"}
	}
	s, err := e.b.NewSampler(llama.SamplerParams{Grammar: grammar})
	if err != nil {
		return "", nil, &infer.InvalidError{Param: "response_format", Reason: err.Error()}
	}
	defer s.Free()
	if len(req.Continue) > 0 { // the answer's own tokens
		if err := s.Follow(req.Continue); err != nil {
			return "", nil, &infer.InvalidError{Param: "continue", Reason: err.Error()}
		}
		return grammar, req.Continue, nil
	}
	if req.Answered == "" {
		return grammar, nil, nil
	}
	// Byte by byte: the tokens' pieces must spell exactly the text (tokenizing it afresh
	// may add a leading space), and llama.cpp's grammar works on bytes anyway.
	answered := make([]int32, len(req.Answered))
	for i := range len(req.Answered) {
		if answered[i] = e.byteToken[req.Answered[i]]; answered[i] < 0 {
			return "", nil, &infer.InvalidError{Param: "answered", Reason: fmt.Sprintf("no token of the vocabulary is the byte %#x alone", req.Answered[i])}
		}
	}
	if err := s.Follow(answered); err != nil {
		return "", nil, &infer.InvalidError{Param: "answered", Reason: err.Error()}
	}
	return grammar, answered, nil
}

func (e *Engine) signal() {
	select {
	case e.wake <- struct{}{}:
	default:
	}
}

// Run warms the model and serves requests until ctx ends. Requests still queued or
// running then end with ErrClosed.
func (e *Engine) Run(ctx context.Context) error {
	if err := e.warm(); err != nil {
		return err
	}
	e.mu.Lock()
	e.running = true
	e.mu.Unlock()
	e.ready.Store(true)
	e.log.Info("engine ready")
	defer e.shutdown()

	stats := &infer.Stats{}
	for {
		if ctx.Err() != nil {
			return nil
		}
		select {
		case task := <-e.tasks:
			task()
		default:
		}
		e.expire(stats)
		e.admit(stats)
		e.stash(stats)
		if len(e.jobs) == 0 {
			e.publishStats(stats)
			timeout := e.nextDeadline()
			select {
			case <-ctx.Done():
				return nil
			case <-e.wake:
			case task := <-e.tasks:
				task()
			case <-timeout:
			}
			continue
		}
		e.step(stats)
		e.publishStats(stats)
	}
}

// warm decodes one token so the first request does not pay for lazy initialisation.
func (e *Engine) warm() error {
	tok := int32(0)
	if len(e.bos) > 0 {
		tok = e.bos[0]
	}
	e.batch.Clear()
	e.batch.Add(tok, 0, 0, true)
	if err := e.b.Decode(e.batch); err != nil {
		return fmt.Errorf("warm up: %w", err)
	}
	e.b.Clear()
	return nil
}

// shutdown ends every request with ErrClosed.
func (e *Engine) shutdown() {
	close(e.stopped)
	e.ready.Store(false)
	e.mu.Lock()
	e.running = false
	waiting := e.waiting
	e.waiting = nil
	e.mu.Unlock()
	for _, j := range append(waiting, e.parked...) {
		e.finish(j, "", infer.ErrClosed)
	}
	e.parked = nil
	for _, j := range slices.Clone(e.jobs) {
		e.finish(j, "", infer.ErrClosed)
	}
	e.log.Info("engine stopped")
}

// nextDeadline is a timer for the earliest queue timeout, or nil when nothing waits.
func (e *Engine) nextDeadline() <-chan time.Time {
	e.mu.Lock()
	defer e.mu.Unlock()
	if len(e.waiting) == 0 {
		return nil
	}
	// The queue is in admission order (interactive first), not arrival order.
	oldest := slices.MinFunc(e.waiting, func(a, b *job) int { return a.submitted.Compare(b.submitted) })
	return time.After(time.Until(oldest.submitted.Add(e.cfg.QueueTimeout)))
}

// expire ends running, parked and waiting requests whose context is done, and waiting ones
// past the queue timeout (a parked request was admitted: it has no queue timeout).
func (e *Engine) expire(stats *infer.Stats) {
	for _, j := range slices.Concat(e.jobs, e.parked) {
		if err := j.ctx.Err(); err != nil {
			stats.Canceled++
			e.parked = slices.DeleteFunc(e.parked, func(x *job) bool { return x == j })
			e.finish(j, "", fmt.Errorf("%w: %w", infer.ErrCanceled, err))
		}
	}
	now := time.Now()
	var canceled, timedOut []*job
	e.mu.Lock()
	refusal := e.overloaded("queue timeout")
	e.waiting = slices.DeleteFunc(e.waiting, func(j *job) bool {
		switch {
		case j.ctx.Err() != nil:
			canceled = append(canceled, j)
		case now.Sub(j.submitted) >= e.cfg.QueueTimeout:
			timedOut = append(timedOut, j)
		default:
			return false
		}
		return true
	})
	e.mu.Unlock()
	for _, j := range canceled {
		stats.Canceled++
		e.finish(j, "", fmt.Errorf("%w: %w", infer.ErrCanceled, j.ctx.Err()))
	}
	for _, j := range timedOut {
		stats.Refused++
		e.log.Warn("request refused", "reason", "queue timeout", "waited", now.Sub(j.submitted))
		e.finish(j, "", refusal)
	}
}

// refuse counts a request refused for a full queue and says when to retry.
func (e *Engine) refuse() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.refused++
	return e.overloaded("queue full")
}

// drainWindow is how many recent completions estimate the rate the queue drains at.
const drainWindow = 32

// overloaded is the refusal of a request that cannot wait, with a RetryAfter from the rate
// requests have been finishing and the queue ahead: the time for the queue to drain, at
// least a second and at most the queue timeout. Callers hold mu.
func (e *Engine) overloaded(reason string) error {
	wait := time.Second
	if n := len(e.done); n >= 2 {
		if span := e.done[n-1].Sub(e.done[0]); span > 0 {
			wait = span / time.Duration(n-1) * time.Duration(len(e.waiting)+1)
		}
	}
	return &infer.OverloadedError{Reason: reason, RetryAfter: min(max(wait, time.Second), e.cfg.QueueTimeout)}
}

package session

import (
	"cmp"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/infernode/infernode/session/infer"
	"github.com/infernode/infernode/session/llama"
)

// This file is the engine goroutine's scheduling: admission, the step, and the end of a
// request. Nothing here may block.

// admit moves queued requests into sequence slots, oldest first. One that does not fit lets
// younger ones pass until it has waited a quarter of the queue timeout; then nothing passes
// it, and running requests drain until it fits. Nothing is admitted while a running
// request waits for cells to grow into: work already started comes first.
//
// Interactive requests go first: one that finds no room preempts a running batch request
// (see preempt) before it waits. Batch requests run only when no interactive one waits and
// a sequence would stay free after them (see infer.Request.Batch): parked ones first, then
// queued ones, oldest first.
func (e *Engine) admit(stats *infer.Stats) {
	if e.stalled > 0 {
		return
	}
	now := time.Now()
	e.mu.Lock()
	defer e.mu.Unlock()
	slices.SortStableFunc(e.waiting, func(a, b *job) int { return cmp.Compare(btoi(a.req.Batch), btoi(b.req.Batch)) })
	for i := 0; i < len(e.waiting) && !e.waiting[i].req.Batch; {
		j := e.waiting[i]
		p, ok := e.place(j)
		if !ok {
			e.mu.Unlock() // Submit need not wait for the copy
			preempted := e.preempt(stats)
			e.mu.Lock()
			if preempted {
				continue // place it again, in the room the batch request left
			}
		}
		if !ok {
			if now.Sub(j.submitted) >= e.cfg.QueueTimeout/4 {
				return
			}
			i++
			continue
		}
		e.waiting = slices.Delete(e.waiting, i, i+1)
		e.mu.Unlock()
		e.start(j, p, stats)
		e.mu.Lock()
	}
	if len(e.waiting) > 0 && !e.waiting[0].req.Batch {
		return // an interactive request waits
	}
	for len(e.parked) > 0 && e.idleSequences() >= 2 {
		j := e.parked[0]
		p, ok := e.placeParked(j)
		if !ok {
			return
		}
		e.parked = e.parked[1:]
		e.mu.Unlock()
		e.resume(j, p, stats)
		e.mu.Lock()
	}
	for len(e.parked) == 0 && len(e.waiting) > 0 && e.idleSequences() >= 2 {
		j := e.waiting[0]
		p, ok := e.place(j)
		if !ok {
			return
		}
		e.waiting = e.waiting[1:]
		e.mu.Unlock()
		e.start(j, p, stats)
		e.mu.Lock()
	}
}

// preempt parks the running batch request holding the fewest cells, to make room for an
// interactive one: its sequence's KV state is copied out and the sequence freed; its
// sampler, text and stream stay as they are, and it resumes (see resume) where it stopped
// when batch work may run again. The client sees a pause. preempt reports false when no
// batch request runs, or as many are parked as the engine has sequences (parked state is
// memory outside the KV cache: this bounds it by the cache's size).
func (e *Engine) preempt(stats *infer.Stats) bool {
	if e.cfg.NoPreempt || len(e.parked) >= e.cfg.Sequences {
		return false
	}
	var victim *job
	for _, j := range e.jobs {
		if j.req.Batch && (victim == nil || len(j.slot.tokens) < len(victim.slot.tokens)) {
			victim = j
		}
	}
	if victim == nil {
		return false
	}
	s := victim.slot
	state, err := e.b.SeqState(s.seq, nil)
	if err != nil {
		e.log.Warn("preemption failed: the batch request runs on", "session", victim.req.SessionID, "err", err)
		return false
	}
	victim.parkedState, victim.parkedTokens = state, slices.Clone(s.tokens)
	e.jobs = slices.DeleteFunc(e.jobs, func(x *job) bool { return x == victim })
	s.job, s.lastUsed, victim.slot = nil, e.tick, nil
	e.drop(s)
	e.parked = append(e.parked, victim)
	stats.Preemptions++
	e.log.Debug("batch request preempted", "session", victim.req.SessionID, "tokens", len(victim.parkedTokens), "state_bytes", len(state))
	return true
}

// placeParked finds a slot and cells for a parked request, as place does for a new one.
func (e *Engine) placeParked(j *job) (placement, bool) {
	p := placement{slot: e.runSlot("")}
	if p.slot == nil {
		return p, false
	}
	var ok bool
	p.evict, ok = e.roomFor(p.slot, j.claim, nil)
	return p, ok
}

// resume installs a parked request's KV state at placement p and runs it again from the
// token it stopped before.
func (e *Engine) resume(j *job, p placement, stats *infer.Stats) {
	for _, v := range p.evict {
		e.drop(v)
		stats.Evictions++
	}
	s := p.slot
	if len(s.tokens) > 0 {
		e.drop(s)
		stats.Evictions++
	}
	e.seqFor(s, stats)
	state, tokens := j.parkedState, j.parkedTokens
	j.parkedState, j.parkedTokens = nil, nil
	if err := e.b.SetSeqState(s.seq, state); err != nil {
		e.b.SeqRemove(s.seq, 0, -1)
		e.finish(j, "", fmt.Errorf("resuming a preempted request: %w", err))
		return
	}
	s.tokens = append(s.tokens[:0], tokens...)
	s.key, s.job, s.replica, s.share, s.origin = j.req.SessionID, j, false, j.req.Share, infer.Local
	e.hold(s.key, false)
	j.slot = s
	e.jobs = append(e.jobs, j)
	e.log.Debug("batch request resumed", "session", j.req.SessionID, "seq", s.seq, "tokens", len(tokens))
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// idleSequences counts the requests that could run beside those running now.
func (e *Engine) idleSequences() int { return e.cfg.Sequences - len(e.jobs) }

// interactivePrefill reports whether an interactive prompt is being prefilled: batch
// decoding pauses meanwhile.
func (e *Engine) interactivePrefill() bool {
	return slices.ContainsFunc(e.jobs, func(j *job) bool { return j.gen == 0 && !j.req.Batch })
}

// placement is where a request will run: its slot, how many of its prompt tokens it finds
// in the KV cache (its conversation's, or from, another conversation's with the same
// beginning), and which idle conversations must be evicted to make room.
type placement struct {
	slot  *slot
	reuse int
	from  *slot // shares its first reuse cells, when not nil
	evict []*slot
}

// minSharedPrefix is the shortest beginning another conversation's cells are shared for:
// a system prompt, a few-shot preamble, a document several questions are asked about.
const minSharedPrefix = 32

// place finds room for j without changing anything. Preference: the conversation's own
// idle slot, then an empty slot, then the least recently used idle one. With a unified KV
// pool it also checks cells: every running request holds its claim, idle conversations
// hold their tokens and are evicted LRU-first as needed to make room for j's first claim.
func (e *Engine) place(j *job) (placement, bool) {
	key := j.req.SessionID
	p := placement{slot: e.runSlot(key)}
	if p.slot == nil {
		return p, false // as many requests run as may
	}
	if key != "" && p.slot.key == key {
		p.reuse = commonPrefix(p.slot.tokens, j.prompt)
		// The last prompt token is always decoded again: its logits start generation.
		p.reuse = min(p.reuse, len(j.prompt)-1)
	}
	if from, n := e.sharedPrefix(j.prompt, j.req.Share, p.slot, true); n > p.reuse {
		p.from, p.reuse = from, n
	}
	if j.req.PromptLogprobs {
		p.from, p.reuse = nil, 0 // every prompt token's logits are wanted: none is reused
	}
	// Cells in host memory come back whole before what the prompt does not share is
	// removed (see start).
	cells := e.firstClaim(j)
	switch {
	case p.from != nil && p.from.host != nil:
		cells += len(p.from.tokens)
	case p.from == nil && p.reuse > 0 && p.slot.host != nil:
		cells = max(cells, len(p.slot.tokens))
	}
	var ok bool
	p.evict, ok = e.roomFor(p.slot, cells, p.from)
	return p, ok
}

// sharedPrefix is the slot of the sharing domain share, other than target, whose cells
// hold the longest beginning of prompt, and how many tokens of it serve (the last prompt
// token is decoded again), when at least minSharedPrefix. Slots of other domains are never
// looked at: a tenant must not be able to tell (by counters or by time) whether another's
// prompt began the way its own does. In a unified pool the cells are shared, not copied
// (llama.cpp's seq_cp marks them as the other sequence's too), so a request whose
// beginning another conversation holds, idle or running, prefills only the rest. A slot
// whose cells are in host memory (see stash) serves only when hosted is true: the caller
// puts them back first.
func (e *Engine) sharedPrefix(prompt []int32, share string, target *slot, hosted bool) (*slot, int) {
	if !e.cfg.UnifiedKV {
		return nil, 0
	}
	var best *slot
	n := 0
	for _, s := range e.slots {
		if s == target || s.share != share || (s.host != nil && !hosted) {
			continue
		}
		if k := commonPrefix(s.tokens, prompt); k > n {
			best, n = s, k
		}
	}
	if n = min(n, len(prompt)-1); n < minSharedPrefix {
		return nil, 0
	}
	return best, n
}

// runSlot is slotFor(key) when another request may run beside those running, else nil.
func (e *Engine) runSlot(key string) *slot {
	if e.idleSequences() <= 0 {
		return nil
	}
	return e.slotFor(key)
}

// slotFor is the slot a conversation's request or import goes to: the conversation's own
// idle slot, else an empty one, else the idle one to evict first (see lru); nil when every
// slot is running.
func (e *Engine) slotFor(key string) *slot {
	var own *slot
	if key != "" {
		for _, s := range e.slots {
			if s.key == key && s.job == nil {
				own = s
			}
		}
	}
	if own != nil {
		return own
	}
	for _, s := range e.slots {
		if s.job == nil && len(s.tokens) == 0 {
			return s
		}
	}
	return e.lru(nil, false)
}

// roomFor is the idle conversations to evict, least recently used first, so that target
// (whose own tokens go) can hold cells in a unified pool; ok is false when evicting every
// idle conversation would not make room. Without a unified pool each sequence has its own
// partition, which a request's token limit and an import's tokens fit.
func (e *Engine) roomFor(target *slot, cells int, keep *slot) (evict []*slot, ok bool) {
	if !e.cfg.UnifiedKV {
		return nil, true
	}
	used := e.claimed() - target.poolCells()
	exclude := []*slot{target, keep}
	for used+cells > e.cells {
		victim := e.lru(exclude, true)
		if victim == nil {
			return nil, false
		}
		used -= len(victim.tokens)
		exclude = append(exclude, victim)
		evict = append(evict, victim)
	}
	return evict, true
}

// firstClaim is the cells a request claims at admission: its prompt and a share of the
// pool for what it generates (all of its token limit when that is smaller), so that no
// request holds the pool up front however many tokens it asks for.
func (e *Engine) firstClaim(j *job) int { return len(j.prompt) + min(j.maxTokens, e.share) }

// claimed is the cells a unified pool has promised: running requests' claims and idle
// conversations' tokens.
func (e *Engine) claimed() int {
	n := 0
	for _, s := range e.slots {
		if s.job != nil {
			n += s.job.claim
		} else {
			n += s.poolCells()
		}
	}
	return n
}

// room makes sure j's next token has a cell within its claim. A used-up claim grows by up
// to a share: from unclaimed cells, else by evicting idle conversations. room reports false
// when the pool has no cell to spare now; j then waits for others to finish (see step).
func (e *Engine) room(j *job, stats *infer.Stats) bool {
	if !e.cfg.UnifiedKV || len(j.slot.tokens) < j.claim {
		return true
	}
	want := min(e.share, len(j.prompt)+j.maxTokens-j.claim)
	free := e.cells - e.claimed()
	for free < want {
		victim := e.lru(nil, true)
		if victim == nil {
			break
		}
		free += len(victim.tokens)
		e.drop(victim)
		stats.Evictions++
	}
	if free <= 0 {
		return false
	}
	j.claim += min(want, free)
	return true
}

// lru is the idle slot holding tokens, not among exclude, to evict first: a replica (a
// copy kept for another node's conversation) before a conversation this node serves, and
// the least recently used among equals. inPool: only slots whose cells are in the pool
// (evicting one whose cells are in host memory frees none).
func (e *Engine) lru(exclude []*slot, inPool bool) *slot {
	var best *slot
	for _, s := range e.slots {
		if s.job != nil || len(s.tokens) == 0 || slices.Contains(exclude, s) || (inPool && s.host != nil) {
			continue
		}
		if best == nil || s.evictsBefore(best) {
			best = s
		}
	}
	return best
}

// evictsBefore reports whether idle slot s goes before o when one must make room: a
// replica before a conversation served here, the least recently used among equals.
func (s *slot) evictsBefore(o *slot) bool {
	return s.replica && !o.replica || s.replica == o.replica && s.lastUsed < o.lastUsed
}

func commonPrefix(a, b []int32) int {
	n := min(len(a), len(b))
	for i := range n {
		if a[i] != b[i] {
			return i
		}
	}
	return n
}

// start admits j at placement p.
func (e *Engine) start(j *job, p placement, stats *infer.Stats) {
	seed := uint32(j.req.Seed)
	if j.req.Seed < 0 {
		seed = e.rng.Uint32()
	}
	lastN := j.req.RepeatLastN
	if lastN == 0 {
		lastN = 64
	}
	sampler, err := e.b.NewSampler(llama.SamplerParams{
		Temperature: j.req.Temperature, TopK: j.req.TopK, TopP: j.req.TopP, MinP: j.req.MinP,
		RepeatLastN: lastN, RepeatPenalty: j.req.RepeatPenalty,
		FrequencyPenalty: j.req.FrequencyPenalty, PresencePenalty: j.req.PresencePenalty, Seed: seed,
		Grammar: j.grammar,
	})
	if err == nil {
		if err = sampler.Follow(j.answered); err != nil {
			sampler.Free()
		}
	}
	if err != nil { // Submit checked the grammar: nothing is held yet
		e.finish(j, "", fmt.Errorf("%w: %w", infer.ErrInvalid, err))
		return
	}
	j.sampler = sampler
	for _, v := range p.evict {
		e.drop(v)
		stats.Evictions++
	}
	s := p.slot
	if s.key != j.req.SessionID && len(s.tokens) > 0 {
		e.drop(s)
		stats.Evictions++
	}
	e.seqFor(s, stats) // a sequence runs beside fewer than Sequences, so one is free or idle
	e.restore(&p)
	cached := p.reuse // from the conversation's own cache
	if p.from != nil {
		e.shareCells(s, p.from, p.reuse)
		cached = 0
		stats.SharedTokens += uint64(p.reuse)
	}
	if p.reuse < len(s.tokens) {
		e.b.SeqRemove(s.seq, p.reuse, -1)
		s.tokens = s.tokens[:p.reuse]
	}
	source := infer.Local
	if cached > 0 {
		source = s.origin
	}
	s.key, s.job, s.replica, s.share, s.origin = j.req.SessionID, j, false, j.req.Share, infer.Local
	e.hold(s.key, false)
	for _, tok := range j.prompt[max(0, len(j.prompt)-lastN):] {
		j.sampler.Accept(tok)
	}
	j.slot, j.cached, j.pending, j.claim = s, cached, j.prompt[p.reuse:], e.firstClaim(j)
	j.filter = newTextFilter(j.req.Stop)
	j.admitted, j.since = time.Now(), e.tick
	j.stream.admit(len(j.prompt), cached, source)
	e.jobs = append(e.jobs, j)
	stats.PromptTokens += uint64(len(j.prompt))
	stats.ReusedTokens += uint64(cached)
	e.log.Debug("request admitted", "session", j.req.SessionID, "seq", s.seq, "prompt", len(j.prompt),
		"reused", p.reuse, "max_tokens", j.maxTokens, "evicted", len(p.evict))
}

// restore puts the cells a placement reuses back into the pool when they are in host
// memory (see stash), and forgets a host copy of the slot's own that it does not reuse.
// A copy that fails to restore is prefilled again.
func (e *Engine) restore(p *placement) {
	if p.from != nil && p.from.host != nil && e.unstash(p.from) != nil {
		p.from, p.reuse = nil, 0
	}
	if s := p.slot; s.host != nil {
		if p.from != nil || p.reuse == 0 {
			e.drop(s)
		} else if e.unstash(s) != nil {
			p.reuse = 0
		}
	}
}

// drop forgets a slot's conversation and frees its KV cells (a partition it holds stays
// its own, free for the next conversation it or seqFor places there).
func (e *Engine) drop(s *slot) {
	e.forget(s)
	if s.seq >= 0 { // a negative id would be every sequence's
		e.b.SeqRemove(s.seq, 0, -1)
	}
	e.unhold(s)
	s.tokens, s.key = s.tokens[:0], ""
}

// unhold forgets that slot s's conversation is held here, unless another slot holds it
// too (two turns of one conversation at once run in two slots).
func (e *Engine) unhold(s *slot) {
	for _, o := range e.slots {
		if o != s && o.key == s.key && s.key != "" {
			e.hold(o.key, o.replica)
			return
		}
	}
	e.held.Delete(s.key)
}

// The prefill rate (Stats.PrefillRate) averages steps that prefilled at least
// minPrefillSample tokens (fewer time the step's overhead, not prefill), over about
// prefillWindow of them.
const (
	minPrefillSample = 16
	prefillWindow    = 8
)

// prefillAge is how many steps a prompt may wait before it is prefilled ahead of shorter
// ones; minPrefillChunk is the least a step prefills when prompts wait, however slow the
// engine.
const (
	prefillAge      = 16
	minPrefillChunk = 16
)

// prefillOrder picks the prompts the step prefills, and how many tokens of each (set in
// fed), after decoding requests took their one token each. Shortest remaining prompt first:
// a short prompt that arrives behind a long one, or early in a burst, gets its first token
// after a step or two instead of after the whole backlog. While requests decode or other
// prompts wait, a step prefills only what the measured prefill rate (Stats.PrefillRate)
// gets through in Config.PrefillSlice, so a long prompt does not hold up every running
// stream's next token and the short prompts behind it (a lone prompt gets the whole
// batch). Not while an interactive request waits for admission, though: then a prompt
// holds a sequence that the queue needs until its first token, and sliced it held one
// for seconds (a survivor after a kill, docs/BENCHMARKS.md, "Prefill whole while requests
// queue"), so the step prefills what the batch holds, as ollama's does. The rate counts
// the decoding rows' time too, so a step that prefills beside them settles at about the
// slice in all, rows included (where decoding rows alone take longer, it prefills
// minPrefillChunk): the slice bounds the streams' gap, not only the prefill's share
// (sizing it by prefill alone was measured: docs/BENCHMARKS.md, "Slices sized by prefill
// alone"). A prompt that has waited prefillAge steps goes first, so a stream of short
// arrivals cannot starve a long one. A prompt after the first is started in a step only
// whole, or with at least half the step's budget: a sliver of it would hold back the
// first tokens of the prompts before it (and every stream's next token) for work that
// yields no token this step. (A wave of 8 equal prompts of 65 tokens with a
// budget of 70 gets its k-th first token after k steps of 65 tokens, not of 70.)
func (e *Engine) prefillOrder(decoding int, rate float64) []*job {
	var ps []*job
	for _, j := range e.jobs {
		if j.gen == 0 {
			ps = append(ps, j)
		}
	}
	budget := e.batch.Cap() - decoding
	if (decoding > 0 || len(ps) > 1) && rate > 0 && !e.queued() {
		budget = min(budget, max(minPrefillChunk, int(rate*e.cfg.PrefillSlice.Seconds())))
	}
	old := func(j *job) bool { return e.tick-j.since >= prefillAge }
	slices.SortStableFunc(ps, func(a, b *job) int {
		if a.req.Batch != b.req.Batch { // interactive prompts first, however long they waited
			return cmp.Compare(btoi(a.req.Batch), btoi(b.req.Batch))
		}
		switch oa, ob := old(a), old(b); {
		case oa != ob && oa:
			return -1
		case oa != ob:
			return 1
		case oa:
			return 0 // both waited long: admission order
		}
		return len(a.pending) - len(b.pending)
	})
	full := budget
	for i, j := range ps {
		if budget == 0 || (i > 0 && len(j.pending) > budget && budget < full/2) {
			return ps[:i]
		}
		j.fed = min(len(j.pending), budget)
		if j.req.PromptLogprobs {
			j.fed = min(j.fed, maxScoredPerStep)
		}
		budget -= j.fed
	}
	return ps
}

// queued reports whether an interactive request waits to be admitted: the step's admit
// left it (every sequence runs, or the cells are spoken for), or it came in since.
func (e *Engine) queued() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return slices.ContainsFunc(e.waiting, func(j *job) bool { return !j.req.Batch })
}

// catchUp moves every prompt still being prefilled onto the cells of a longer beginning
// that another slot holds by now, so a burst of requests with one system prompt prefills
// it once: shortest first gives one of them the step, and the others take its cells
// before the next.
func (e *Engine) catchUp(stats *infer.Stats) {
	for _, j := range e.jobs {
		if j.gen != 0 || j.req.PromptLogprobs {
			continue
		}
		done := len(j.slot.tokens)
		from, n := e.sharedPrefix(j.prompt, j.req.Share, j.slot, false)
		if n <= done {
			continue
		}
		e.shareCells(j.slot, from, n)
		j.pending = j.prompt[n:]
		stats.SharedTokens += uint64(n - done)
	}
}

// shareCells gives s the first n cells of from in place of its own (a shorter beginning of
// the same tokens, or none): s then holds from's first n tokens.
func (e *Engine) shareCells(s, from *slot, n int) {
	e.b.SeqRemove(s.seq, 0, -1)
	e.b.SeqCopy(from.seq, s.seq, n)
	s.tokens = append(s.tokens[:0], from.tokens[:n]...)
}

// step builds one batch (a token for every decoding request, then prefill chunks as
// prefillOrder picks them), decodes it, and samples for every request whose logits it
// produced.
func (e *Engine) step(stats *infer.Stats) {
	e.tick++
	e.catchUp(stats)
	b := e.batch
	b.Clear()
	var feeds, stalled []*job // feeds: a token for each decoding request, then prefill chunks
	pauseBatch := e.interactivePrefill()
	for _, j := range e.jobs {
		j.logitIdx, j.fed, j.scored = -1, 0, j.scored[:0]
		if j.gen == 0 || (pauseBatch && j.req.Batch) {
			continue
		}
		if !e.room(j, stats) {
			stalled = append(stalled, j)
			continue
		}
		j.fed = 1
		feeds = append(feeds, j)
	}
	decoding := len(feeds)
	stats.MaxDecoding = max(stats.MaxDecoding, decoding)
	e.stalled = len(stalled)
	feeds = append(feeds, e.prefillOrder(decoding, stats.PrefillRate)...)
	if !e.cfg.UnifiedKV {
		// llama.cpp splits a batch over partitions into micro-batches of consecutive
		// sequence ids, lowest first, each a pass over the weights: in id order, with the
		// running sequences next to each other (see seqFor), the rows take one.
		slices.SortStableFunc(feeds, func(a, b *job) int { return a.slot.seq - b.slot.seq })
	}
	for _, j := range feeds {
		for i, tok := range j.pending[:j.fed] {
			last := j.gen > 0 || i == len(j.pending)-1 // a decoding row, or the prompt's last token
			idx := b.Add(tok, len(j.slot.tokens)+i, j.slot.seq, last || j.req.PromptLogprobs)
			if j.req.PromptLogprobs && j.gen == 0 {
				j.scored = append(j.scored, idx)
			}
			if last {
				j.logitIdx = idx
			}
		}
	}
	if b.Len() == 0 && len(stalled) > 0 {
		// Every running request waits for cells the others hold: end the one holding most,
		// cleanly, at the length it reached.
		j := slices.MaxFunc(stalled, func(a, b *job) int { return a.claim - b.claim })
		e.log.Warn("KV pool exhausted: request ended early", "session", j.req.SessionID, "tokens", j.gen, "max_tokens", j.maxTokens)
		e.finish(j, "length", nil)
		e.stalled--
		return
	}

	start := time.Now()
	err := e.b.Decode(b)
	took := time.Since(start)
	stats.StepTimeMicros += uint64(took.Microseconds())
	if prefill := b.Len() - decoding; err == nil && prefill >= minPrefillSample {
		rate := float64(prefill) / took.Seconds()
		if stats.PrefillRate == 0 {
			stats.PrefillRate = rate
		}
		stats.PrefillRate += (rate - stats.PrefillRate) / prefillWindow
	}
	stats.Steps++
	stats.BatchedTokens += uint64(b.Len())
	if err != nil {
		// The KV state of every sequence in the batch is unknown now: end those requests
		// and forget their conversations rather than answer from a corrupt cache.
		e.log.Error("decode failed", "err", err, "batch", b.Len())
		for _, j := range slices.Clone(e.jobs) {
			if j.fed > 0 {
				s := j.slot
				e.finish(j, "", err)
				e.drop(s)
			}
		}
		return
	}
	var sampling, prefilled []*job
	for _, j := range e.jobs {
		if j.fed == 0 {
			continue
		}
		e.score(j)
		j.slot.tokens = append(j.slot.tokens, j.pending[:j.fed]...)
		j.pending = j.pending[j.fed:]
		switch {
		case j.logitIdx < 0:
		case j.req.PrefillOnly:
			prefilled = append(prefilled, j)
		default:
			sampling = append(sampling, j)
		}
	}
	for _, j := range prefilled {
		e.finish(j, "length", nil) // the prompt is in: nothing to generate
	}
	e.sample(sampling)
	for _, j := range sampling {
		e.emit(j, j.next, stats)
	}
}

// maxScoredPerStep bounds the prompt tokens of one request whose logits a step keeps (a
// row of the vocabulary each: 64 rows of a 50k vocabulary are 12.5 MiB).
const maxScoredPerStep = 64

// score computes, for a request that asked for its prompt's logprobs, each fed prompt
// token's logits' verdict on the token after it, before the step's tokens join the slot.
func (e *Engine) score(j *job) {
	if len(j.scored) == 0 {
		return
	}
	base := len(j.slot.tokens) // the position of the first token fed this step
	if base == 0 {
		first := e.logprob(nil, j.prompt[0], 0)
		j.prompted = append(j.prompted, first)
	}
	for k, idx := range j.scored {
		if next := base + k + 1; next < len(j.prompt) {
			j.prompted = append(j.prompted, e.logprob(e.b.Logits(idx), j.prompt[next], j.req.TopLogprobs))
		}
	}
}

// sample picks every job's next token. A row of a 50k vocabulary costs about half a
// millisecond through llama.cpp's chain (44 µs at a temperature alone), so rows are
// shared among as many threads as llama.cpp uses (its workers only poll between graphs).
func (e *Engine) sample(jobs []*job) {
	for _, j := range jobs {
		j.logits = e.b.Logits(j.logitIdx)
	}
	workers := min(e.cfg.Threads, len(jobs))
	if workers <= 1 {
		for _, j := range jobs {
			j.next = j.sampler.Sample(j.logits)
		}
		return
	}
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for i := w; i < len(jobs); i += workers {
				jobs[i].next = jobs[i].sampler.Sample(jobs[i].logits)
			}
		})
	}
	wg.Wait()
}

// emit handles a sampled token: end of turn, text for the stream, stop strings, limits.
func (e *Engine) emit(j *job, tok int32, stats *infer.Stats) {
	if tok < 0 { // a grammar that allows nothing more (it ended without an end of turn)
		e.finish(j, "stop", nil)
		return
	}
	if j.gen == 0 {
		j.first = time.Now()
	}
	j.gen++
	stats.Generated++
	if e.b.IsEOG(tok) {
		e.finish(j, "stop", nil)
		return
	}
	if j.req.Logprobs {
		j.logprobs = append(j.logprobs, e.logprob(j.logits, tok, j.req.TopLogprobs))
	}
	piece := e.b.Piece(tok)
	text, stopped := j.filter.push(piece)
	j.out += len(piece)
	j.stream.push(text, tok, j.out, j.filter.pending())
	switch {
	case stopped:
		e.finish(j, "stop", nil)
	case j.gen >= j.maxTokens:
		e.finish(j, "length", nil)
	default:
		j.pending = append(j.pending[:0:0], tok)
	}
}

// finish ends j, frees its slot (keeping the conversation's KV for its next turn) and
// tells the reader. reason is empty when err is not nil.
func (e *Engine) finish(j *job, reason string, err error) {
	now := time.Now()
	if s := j.slot; s != nil {
		s.job, s.lastUsed = nil, e.tick
		e.jobs = slices.DeleteFunc(e.jobs, func(x *job) bool { return x == j })
		j.sampler.Free()
		if s.key == "" {
			e.drop(s)
		}
		// An older copy of this conversation (from a turn that ran concurrently) is stale.
		for _, o := range e.slots {
			if o != s && o.job == nil && o.key != "" && o.key == s.key {
				e.drop(o)
			}
		}
		if err == nil {
			if rest := j.filter.flush(); rest != "" {
				j.stream.pushText(rest)
			}
		}
	} else if j.sampler != nil { // parked
		j.sampler.Free()
	}
	res := infer.Result{FinishReason: reason, PromptTokens: len(j.prompt), CachedTokens: j.cached,
		CompletionTokens: j.gen, Total: now.Sub(j.submitted), Logprobs: j.logprobs, PromptLogprobs: j.prompted, Err: err}
	if !j.admitted.IsZero() {
		res.Queued = j.admitted.Sub(j.submitted)
	}
	if !j.first.IsZero() {
		res.FirstToken = j.first.Sub(j.submitted)
	}
	if err != nil {
		e.log.Debug("request failed", "session", j.req.SessionID, "err", err)
	} else {
		e.mu.Lock()
		if len(e.done) == drainWindow {
			e.done = e.done[1:]
		}
		e.done = append(e.done, now)
		e.mu.Unlock()
	}
	j.stream.finish(res)
}

// logprob is tok's log probability in a logits row and the top most likely tokens, by a
// log-softmax over the whole vocabulary (done only for requests that ask).
func (e *Engine) logprob(row []float32, tok int32, top int) infer.TokenLogprob {
	piece := func(t int32) string { return strings.ToValidUTF8(string(e.b.Piece(t)), "\uFFFD") }
	if row == nil { // no distribution: the first token of a prompt
		return infer.TokenLogprob{Token: piece(tok)}
	}
	hi := row[0]
	for _, x := range row {
		hi = max(hi, x)
	}
	var sum float64
	for _, x := range row {
		sum += math.Exp(float64(x - hi))
	}
	lse := float64(hi) + math.Log(sum)
	out := infer.TokenLogprob{Token: piece(tok), Logprob: float32(float64(row[tok]) - lse)}
	if top == 0 {
		return out
	}
	best := make([]int32, 0, top+1) // token ids, most likely first
	for t := range row {
		i := len(best)
		for i > 0 && row[best[i-1]] < row[t] {
			i--
		}
		if i < top {
			best = slices.Insert(best, i, int32(t))
			if len(best) > top {
				best = best[:top]
			}
		}
	}
	for _, t := range best {
		out.Top = append(out.Top, infer.TopLogprob{Token: piece(t), Logprob: float32(float64(row[t]) - lse)})
	}
	return out
}

// publishStats stores a snapshot of the counters and the slots' state for Stats.
func (e *Engine) publishStats(counters *infer.Stats) {
	s := *counters
	s.Sequences, s.KVCells, s.Running, s.Parked = e.cfg.Sequences, e.cells, len(e.jobs), len(e.parked)
	s.HostTokens = e.hostTokens
	if e.b != nil {
		for _, sl := range e.slots {
			used := 0
			if sl.seq >= 0 {
				used = e.b.SeqPosMax(sl.seq) + 1
			}
			s.KVUsed += used
			if sl.job != nil {
				s.KVActive += used
			}
			if sl.job == nil && len(sl.tokens) > 0 {
				s.Conversations++
				if sl.replica {
					s.Replicas++
				}
			}
		}
	}
	e.stats.Store(&s)
}

package session

import (
	"slices"
	"time"
	"unsafe"

	"github.com/infernode/infernode/session/infer"
)

// Idle conversations' cells in host memory (Config.HostKV). llama.cpp's attention reads
// every cell of a unified pool up to the highest one in use, for every token of every
// step, and only then skips the cells the mask hides: a conversation kept for its next
// turn costs every stream decoding beside it about 0.23 µs a cell a token on the realistic
// shape (BenchmarkIdleCells). stash copies such a conversation's sequence state out and
// frees its cells; its slot keeps the tokens, so routing, Holds, Snapshot and the next
// turn's prefix match see it as before, and unstash puts the cells back (wherever
// llama.cpp finds room: low in a pool emptied this way) when the next turn is admitted.

// stashAfter is how many steps a conversation stays idle in the pool before it is moved
// out, so that one whose next turn comes within a few steps is left where it is. A move
// out and back is not free (BenchmarkSeqState, 1,024 tokens of the realistic shape): out
// 3.4 µs a cell into a buffer touched before (7.6 when the history's cells lie
// interleaved with another's), 26-34 µs into a fresh one, whose pages fault on their
// first write (91 µs with 4 KiB pages: see keep.Fresh); back 2-4 µs. A step with b
// tokens decoding pays 0.23b µs a cell it reads, so a move into a kept buffer pays for
// itself after a few dozen tokens decoded beside the history (64 steps measured no better
// than 8; docs/BENCHMARKS.md).
const stashAfter = 8

// The buffers of restored conversations' states are kept for the next move out (spare)
// while they and the states in host memory fit in Config.HostCells tokens' worth of
// bytes, so host memory stays within its bound with them.

// poolCells is the cells of the pool slot s holds while idle: none while stashed.
func (s *slot) poolCells() int {
	if s.host != nil {
		return 0
	}
	return len(s.tokens)
}

// stash moves the least recently used conversation that has stayed idle in the pool for
// stashAfter steps out to host memory, while requests run beside it, if host memory holds
// at most Config.HostCells tokens with it. One a step: each is a copy on the engine
// goroutine, between the streams' tokens. Partitions are moved out only when another
// conversation needs one (see seqFor): a partition's cells cost no other sequence's
// attention anything.
func (e *Engine) stash(stats *infer.Stats) {
	if !e.cfg.HostKV || !e.cfg.UnifiedKV || len(e.jobs) == 0 {
		return
	}
	var victim *slot
	for _, s := range e.slots {
		if s.job != nil || !s.inPool() || e.tick-s.lastUsed < stashAfter || !e.hostRoom(s) {
			continue
		}
		if victim == nil || s.lastUsed < victim.lastUsed {
			victim = s
		}
	}
	if victim != nil && e.moveOut(victim) {
		stats.HostMoves++
	}
}

// moveOut copies an idle conversation's sequence state to host memory and frees its
// cells; false when the copy failed and it stays in the pool.
func (e *Engine) moveOut(victim *slot) bool {
	buf := e.takeSpare(len(victim.tokens) * e.cellBytes)
	start := time.Now()
	state, err := e.b.SeqState(victim.seq, buf)
	if buf != nil && (err != nil || len(state) == 0 || unsafe.SliceData(state) != unsafe.SliceData(buf)) {
		e.keepSpare(buf) // too small, or the copy failed
	}
	if err != nil || len(state) == 0 {
		e.log.Warn("moving an idle conversation to host memory failed: it stays in the pool",
			"session", victim.key, "tokens", len(victim.tokens), "err", err)
		return false
	}
	e.b.SeqRemove(victim.seq, 0, -1)
	victim.host = state
	e.hostTokens += len(victim.tokens)
	e.hostBytes += len(state)
	e.cellBytes = max(e.cellBytes, (len(state)+len(victim.tokens)-1)/len(victim.tokens))
	e.trimSpares()
	e.log.Debug("idle conversation moved to host memory", "session", victim.key, "tokens", len(victim.tokens),
		"bytes", len(state), "took", time.Since(start))
	return true
}

// seqFor gives slot s the llama.cpp sequence it is to hold its cells in, before it runs or
// takes an import. In a unified pool that is its own, always. Without one there are only
// Sequences of them (the partitions) for more conversations (Config.Conversations), and a
// conversation owns one while its cells are in it. llama.cpp splits a step over
// partitions into a pass over the weights for each run of consecutive sequence ids (see
// step), so s takes the partition that runs nothing next to the most running ones; among
// equals its own, then a free one, then the least recently used conversation's. The idle
// conversation there moves out to host memory, or is dropped when host memory has no room
// for it; s's own cells move over through host memory, or stay where they are when they
// cannot. When every partition runs a request s keeps none: admission runs fewer than
// Sequences, and an import asks seatable first. stats, when not nil, counts the moves and
// evictions.
func (e *Engine) seqFor(s *slot, stats *infer.Stats) {
	if e.cfg.UnifiedKV || !e.cfg.HostKV {
		return // a slot a sequence, for good: its own, or a partition without host memory
	}
	running := make([]bool, e.cfg.Sequences+2) // by sequence id + 1, with a margin each side
	for _, o := range e.slots {
		if o.seq >= 0 && o.job != nil {
			running[o.seq+1] = true
		}
	}
	rank := func(o *slot) int { // higher is better
		r := 4 * (btoi(running[o.seq]) + btoi(running[o.seq+2]))
		switch {
		case o == s:
			r += 3
		case !o.inPool():
			r += 2
		}
		return r
	}
	var best *slot
	for _, o := range e.slots {
		if !o.idlePartition() {
			continue
		}
		if best == nil || rank(o) > rank(best) || rank(o) == rank(best) && o.inPool() && o.evictsBefore(best) {
			best = o
		}
	}
	if best == nil || best == s || s.seq >= 0 && s.inPool() && !e.moveOutOrDrop(s, false, stats) {
		return // it keeps what it has: no partition to take, its own, or cells that stay in it
	}
	e.moveOutOrDrop(best, true, stats)
	s.seq, best.seq = best.seq, s.seq
}

// seatable reports whether s holds a sequence after seqFor: one of its own, or a partition
// no request runs in. Nothing changes.
func (e *Engine) seatable(s *slot) bool {
	return s.seq >= 0 || slices.ContainsFunc(e.slots, (*slot).idlePartition)
}

// idlePartition reports whether the slot holds a sequence no request runs in.
func (s *slot) idlePartition() bool { return s.seq >= 0 && s.job == nil }

// moveOutOrDrop moves an idle conversation's cells out of its partition to host memory,
// when they are in one and host memory has room; else it drops the conversation if drop
// is set. It reports whether the partition is free of the conversation's cells.
func (e *Engine) moveOutOrDrop(s *slot, drop bool, stats *infer.Stats) bool {
	if !s.inPool() {
		return true
	}
	if e.hostRoom(s) && e.moveOut(s) {
		if stats != nil {
			stats.HostMoves++
		}
		return true
	}
	if drop {
		e.drop(s)
		if stats != nil {
			stats.Evictions++
		}
	}
	return drop
}

// hostRoom reports whether host memory holds s's tokens beside those it holds already
// (Config.HostCells).
func (e *Engine) hostRoom(s *slot) bool { return e.hostTokens+len(s.tokens) <= e.hostCells }

// inPool reports whether the slot's cells are in the pool (it holds tokens, not in host
// memory).
func (s *slot) inPool() bool { return len(s.tokens) > 0 && s.host == nil }

// unstash puts a stashed conversation's cells back into the pool. On failure the
// conversation is dropped, as an eviction would.
func (e *Engine) unstash(s *slot) error {
	start := time.Now()
	key, tokens := s.key, len(s.tokens)
	if err := e.setState(s, s.host, tokens); err != nil {
		e.log.Warn("restoring a conversation from host memory failed: its history is prefilled again",
			"session", key, "tokens", tokens, "err", err)
		return err
	}
	e.forget(s)
	e.log.Debug("conversation restored from host memory", "session", s.key, "tokens", len(s.tokens), "took", time.Since(start))
	return nil
}

// forget releases a stashed slot's host copy (its buffer kept for the next stash).
func (e *Engine) forget(s *slot) {
	if s.host == nil {
		return
	}
	e.hostTokens -= len(s.tokens)
	e.hostBytes -= len(s.host)
	e.keepSpare(s.host)
	s.host = nil
}

// takeSpare returns the smallest kept buffer with room for n bytes, or nil.
func (e *Engine) takeSpare(n int) []byte {
	best := -1
	for i, b := range e.spare {
		if cap(b) >= n && (best < 0 || cap(b) < cap(e.spare[best])) {
			best = i
		}
	}
	if best < 0 {
		return nil
	}
	b := e.spare[best]
	e.spare = slices.Delete(e.spare, best, best+1)
	e.spareBytes -= cap(b)
	return b[:0]
}

// keepSpare keeps buf for a later stash, within the host memory bound.
func (e *Engine) keepSpare(buf []byte) {
	e.spare = append(e.spare, buf[:0])
	e.spareBytes += cap(buf)
	e.trimSpares()
}

// trimSpares drops the oldest kept buffers until they and the states in host memory fit
// in hostCells tokens' worth of bytes.
func (e *Engine) trimSpares() {
	for len(e.spare) > 0 && e.hostBytes+e.spareBytes > e.hostCells*e.cellBytes {
		e.spareBytes -= cap(e.spare[0])
		e.spare[0] = nil
		e.spare = e.spare[1:]
	}
}

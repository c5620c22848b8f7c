package session

import (
	"bytes"
	"cmp"
	"context"
	"fmt"
	"io"
	"slices"
	"time"

	"github.com/infernode/infernode/internal/keep"
	"github.com/infernode/infernode/session/infer"
)

// Moving a conversation's KV cache between engines: Export writes an idle conversation's
// tokens and llama.cpp sequence state as a KV frame (kvframe.go), Import installs one. The
// state is copied on the engine goroutine between steps; the frame is written and read
// outside it.

// do runs f on the engine goroutine between steps and waits for it.
func (e *Engine) do(ctx context.Context, f func()) error {
	if !e.Ready() {
		return infer.ErrClosed
	}
	done := make(chan struct{})
	select {
	case e.tasks <- func() { f(); close(done) }:
	case <-e.stopped:
		return infer.ErrClosed
	case <-ctx.Done():
		return fmt.Errorf("%w: %w", infer.ErrCanceled, ctx.Err())
	}
	<-done
	return nil
}

// Snapshot is a conversation's tokens and llama.cpp sequence state copied out of the
// engine, written as a KV frame by WriteTo (infer.Frame). It holds the one copy of the
// state a transfer needs; Release returns its buffer for the next one.
type Snapshot struct {
	head   []byte // the frame up to the state: magic, header, tokens, checksums
	state  []byte
	tokens int
	buf    *[]byte
}

// Snapshot copies conversation key's cached KV out of the engine (between steps). The
// conversation stays cached here. ErrNotCached: it is not idle here.
func (e *Engine) Snapshot(ctx context.Context, key string) (*Snapshot, error) {
	if key == "" {
		return nil, fmt.Errorf("%w: export needs a conversation key", infer.ErrInvalid)
	}
	var tokens []int32
	var state []byte
	var share string
	var err error
	buf := stateBufs.Get()
	doErr := e.do(ctx, func() {
		for _, s := range e.slots {
			if s.key == key && s.job == nil && len(s.tokens) > 0 {
				tokens, share = append([]int32(nil), s.tokens...), s.share
				if s.host != nil { // its cells are in host memory (see stash)
					state = append((*buf)[:0], s.host...)
				} else {
					state, err = e.b.SeqState(s.seq, *buf)
				}
				if cap(state) > cap(*buf) {
					*buf = state
				}
				return
			}
		}
		err = infer.ErrNotCached
	})
	if err = cmp.Or(doErr, err); err != nil {
		stateBufs.Put(buf)
		return nil, err
	}
	h := frameHeader{Fingerprint: e.cfg.Fingerprint, KVType: e.cfg.KVType, Key: key, Share: share}
	head, err := frameHead(h, tokens, state)
	if err != nil {
		stateBufs.Put(buf)
		return nil, fmt.Errorf("export %q: %w", key, err)
	}
	return &Snapshot{head: head, state: state, tokens: len(tokens), buf: buf}, nil
}

// WriteTo writes the KV frame.
func (s *Snapshot) WriteTo(w io.Writer) (int64, error) {
	n, err := w.Write(s.head)
	if err != nil {
		return int64(n), err
	}
	m, err := w.Write(s.state)
	return int64(n + m), err
}

// Reader reads the frame from memory: a request body that needs no goroutine to write it.
func (s *Snapshot) Reader() io.Reader {
	return io.MultiReader(bytes.NewReader(s.head), bytes.NewReader(s.state))
}

// Len is the frame's size; Tokens the conversation's tokens.
func (s *Snapshot) Len() int    { return len(s.head) + len(s.state) }
func (s *Snapshot) Tokens() int { return s.tokens }

// Release returns the state's buffer; the snapshot is not used after.
func (s *Snapshot) Release() {
	if s.buf != nil {
		stateBufs.Put(s.buf)
		s.buf, s.state = nil, nil
	}
}

// Export writes conversation key's cached KV to w as a KV frame and returns how many
// tokens it holds. The conversation stays cached here.
func (e *Engine) Export(ctx context.Context, key string, w io.Writer) (int, error) {
	s, err := e.Snapshot(ctx, key)
	if err != nil {
		return 0, err
	}
	defer s.Release()
	if _, err := s.WriteTo(w); err != nil {
		return 0, fmt.Errorf("export %q: %w", key, err)
	}
	return s.tokens, nil
}

// stateBufs hold the states of snapshots between them: a fresh buffer of tens of
// megabytes costs page faults and garbage collection every time (see internal/keep), and
// on a machine whose cores all run llama.cpp's threads that time comes out of the steps of
// the streams decoding (measured on the receiving side, when imports still copied the
// state: BenchmarkImportStall's p99 inter-token latency was 2.9-4.6x the baseline with a
// fresh buffer for every import, 1.4x with a reused one). Two are kept (kvmove's
// concurrent transfers), of at most 256 MiB.
var stateBufs = keep.New(2, 256<<20)

// Import checks a KV frame and installs it as its conversation's cache (from where the
// state lies in frame: no copy is made), replacing any
// idle copy of that conversation here. A frame for another model or KV type, another
// format version, a truncated or corrupt one is refused (ErrFrame) and changes nothing;
// so is one arriving while that conversation runs a turn here, or when every sequence is
// busy (ErrOverloaded). want, when not empty, is the conversation asked for (a pull): a
// frame of any other is refused (ErrFrame) before anything is installed.
//
// origin says how the frame came here; the next turn's stream reports it (Source). A
// replica is a copy kept for a conversation another node serves, for when that node fails:
// it is evicted before any conversation served here.
func (e *Engine) Import(ctx context.Context, frame []byte, origin infer.Origin, want string) (infer.Imported, error) {
	h, tokens, state, err := parseFrame(frame, frameHeader{Fingerprint: e.cfg.Fingerprint, KVType: e.cfg.KVType}, e.seqCells-1)
	if err != nil {
		return infer.Imported{}, err
	}
	if want != "" && h.Key != want {
		return infer.Imported{}, fmt.Errorf("%w: the frame is of conversation %q, %q was asked for", infer.ErrFrame, h.Key, want)
	}
	res := infer.Imported{Key: h.Key, Tokens: len(tokens), Bytes: len(state)}
	if err := e.do(ctx, func() {
		start := time.Now()
		err = e.install(h.Key, h.Share, tokens, state, origin)
		res.Stall = time.Since(start)
	}); err != nil {
		return res, err
	}
	if err != nil {
		return res, err
	}
	e.log.Debug("conversation imported", "session", h.Key, "tokens", len(tokens), "bytes", len(state), "stall", res.Stall)
	return res, nil
}

// install puts an imported conversation into a slot: its own idle one, else an empty one,
// else the least recently used idle one, evicting idle conversations for cells as
// admission would. Engine goroutine only.
func (e *Engine) install(key, share string, tokens []int32, state []byte, origin infer.Origin) error {
	replica := origin == infer.Replica
	for _, s := range e.slots {
		if s.key == key && s.job != nil {
			return fmt.Errorf("%w: conversation %q is running a turn here", infer.ErrOverloaded, key)
		}
	}
	target := e.slotFor(key)
	if target == nil {
		return fmt.Errorf("%w: every sequence is running", infer.ErrOverloaded)
	}
	if target.key == key && len(target.tokens) >= len(tokens) {
		// The copy here is as long (the same turn's replica, or a later turn ran here):
		// keep it, but as what the frame says it is now (a replica becomes this node's).
		target.replica = target.replica && replica
		e.hold(key, target.replica)
		if !replica {
			target.origin = origin // a hand-off or push of what a replica held already: it came all the same
		}
		return nil
	}
	if !e.seatable(target) {
		return fmt.Errorf("%w: every sequence is running", infer.ErrOverloaded)
	}
	evict, ok := e.roomFor(target, len(tokens), nil)
	if !ok {
		return fmt.Errorf("%w: no room for %d cells", infer.ErrOverloaded, len(tokens))
	}
	for _, v := range evict {
		e.drop(v)
	}
	e.drop(target)
	e.seqFor(target, nil)
	if err := e.setState(target, state, len(tokens)); err != nil {
		return fmt.Errorf("%w: %w", infer.ErrFrame, err)
	}
	e.tick++ // the LRU clock: a later import is more recent, even with no step between
	target.key, target.tokens, target.lastUsed, target.replica, target.share = key, append(target.tokens[:0], tokens...), e.tick, replica, share
	target.origin = origin
	e.hold(key, replica)
	return nil
}

// setState installs a sequence state into slot s's sequence, which must then hold exactly
// tokens positions: a state that says otherwise (forged, or cut from another conversation)
// would put cells at positions the engine does not account for, and the next decode would
// fail for every sequence in its batch. On failure s is dropped, with whatever llama.cpp
// half-restored.
func (e *Engine) setState(s *slot, state []byte, tokens int) error {
	err := e.b.SetSeqState(s.seq, state)
	if err == nil {
		if got := e.b.SeqPosMax(s.seq); got != tokens-1 {
			err = fmt.Errorf("the state holds positions up to %d, for %d tokens", got, tokens)
		}
	}
	if err != nil {
		e.drop(s)
	}
	return err
}

// Holds reports whether conversation key has KV here (read without the engine
// goroutine: a conversation evicted a moment ago may still read as held).
func (e *Engine) Holds(key string) bool {
	_, ok := e.held.Load(key)
	return ok
}

// Owns reports whether conversation key has KV here as this node's own, not as a
// replica kept for another node (the same approximation as Holds).
func (e *Engine) Owns(key string) bool {
	replica, ok := e.held.Load(key)
	return ok && !replica.(bool)
}

// hold records that conversation key has KV here, as a replica or not (see Owns).
func (e *Engine) hold(key string, replica bool) {
	if key != "" {
		e.held.Store(key, replica)
	}
}

// Demote keeps conversation key's idle copy here as a replica, once it has moved to its
// owner: evicted before any conversation served here, and not handed off again.
func (e *Engine) Demote(ctx context.Context, key string) error {
	return e.do(ctx, func() {
		for _, s := range e.slots {
			if s.key == key && s.job == nil {
				s.replica = true
				e.hold(key, true)
			}
		}
	})
}

// Conversations are the keys of the conversations cached here, most recently used first;
// replicas (copies kept for other nodes' conversations) are not among them.
func (e *Engine) Conversations(ctx context.Context) ([]string, error) {
	type idle struct {
		key  string
		used uint64
	}
	var held []idle
	err := e.do(ctx, func() {
		for _, s := range e.slots {
			if s.key != "" && s.job == nil && len(s.tokens) > 0 && !s.replica {
				held = append(held, idle{s.key, s.lastUsed})
			}
		}
	})
	slices.SortFunc(held, func(a, b idle) int { return cmp.Compare(b.used, a.used) })
	keys := make([]string, len(held))
	for i, h := range held {
		keys[i] = h.key
	}
	return keys, err
}

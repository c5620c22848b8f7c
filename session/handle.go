package session

import (
	"context"
	"sync/atomic"

	"github.com/infernode/infernode/session/infer"
)

// Handle is an engine that can be handed out before it exists: a node serves its API
// (answering "not ready") while the model loads. Until Set, it is not ready and refuses
// requests with ErrClosed. It is safe for concurrent use.
type Handle struct {
	e atomic.Pointer[Engine]
}

// Set makes e the engine that serves requests.
func (h *Handle) Set(e *Engine) { h.e.Store(e) }

// Submit starts a generation; see Engine.Submit.
func (h *Handle) Submit(ctx context.Context, req infer.Request) (infer.Stream, error) {
	e := h.e.Load()
	if e == nil {
		return nil, infer.ErrClosed
	}
	s, err := e.Submit(ctx, req)
	if err != nil {
		return nil, err // not a typed nil *Stream in an interface
	}
	return s, nil
}

// ChatPrompt formats a conversation; see Engine.ChatPrompt.
func (h *Handle) ChatPrompt(msgs []infer.Message) (string, error) {
	e := h.e.Load()
	if e == nil {
		return "", infer.ErrClosed
	}
	return e.ChatPrompt(msgs)
}

// Tokenize and Detokenize: see Engine.Tokenize and Engine.Detokenize. SeqCells is the
// tokens one conversation holds (0 before Set).
func (h *Handle) Tokenize(text string, addSpecial bool) ([]int32, error) {
	e := h.e.Load()
	if e == nil {
		return nil, infer.ErrClosed
	}
	return e.Tokenize(text, addSpecial)
}

func (h *Handle) Detokenize(tokens []int32) (string, error) {
	e := h.e.Load()
	if e == nil {
		return "", infer.ErrClosed
	}
	return e.Detokenize(tokens)
}

func (h *Handle) SeqCells() int {
	if e := h.e.Load(); e != nil {
		return e.SeqCells()
	}
	return 0
}

// Stats is the engine's snapshot, or zero before Set.
func (h *Handle) Stats() infer.Stats {
	if e := h.e.Load(); e != nil {
		return e.Stats()
	}
	return infer.Stats{}
}

// Ready reports whether the engine is set, loaded and warmed.
func (h *Handle) Ready() bool {
	e := h.e.Load()
	return e != nil && e.Ready()
}

// Snapshot copies a conversation's KV out for a transfer; see Engine.Snapshot.
func (h *Handle) Snapshot(ctx context.Context, key string) (infer.Frame, error) {
	e := h.e.Load()
	if e == nil {
		return nil, infer.ErrClosed
	}
	s, err := e.Snapshot(ctx, key)
	if err != nil {
		return nil, err
	}
	return s, nil
}

// Import installs a KV frame; see Engine.Import.
func (h *Handle) Import(ctx context.Context, frame []byte, origin infer.Origin, want string) (infer.Imported, error) {
	e := h.e.Load()
	if e == nil {
		return infer.Imported{}, infer.ErrClosed
	}
	return e.Import(ctx, frame, origin, want)
}

// Holds reports whether a conversation has KV here; see Engine.Holds.
func (h *Handle) Holds(key string) bool {
	e := h.e.Load()
	return e != nil && e.Holds(key)
}

// Owns reports whether a conversation has KV here as this node's own; see Engine.Owns.
func (h *Handle) Owns(key string) bool {
	e := h.e.Load()
	return e != nil && e.Owns(key)
}

// Demote keeps a conversation that moved away as a replica; see Engine.Demote.
func (h *Handle) Demote(ctx context.Context, key string) error {
	e := h.e.Load()
	if e == nil {
		return infer.ErrClosed
	}
	return e.Demote(ctx, key)
}

// Conversations lists the conversations cached; see Engine.Conversations.
func (h *Handle) Conversations(ctx context.Context) ([]string, error) {
	e := h.e.Load()
	if e == nil {
		return nil, infer.ErrClosed
	}
	return e.Conversations(ctx)
}

var _ infer.Stream = (*Stream)(nil)

// Prefixes and PromptPrefixes: see Engine.Prefixes and Engine.PromptPrefixes.
func (h *Handle) Prefixes(ctx context.Context, limit int) ([]uint64, error) {
	e := h.e.Load()
	if e == nil {
		return nil, infer.ErrClosed
	}
	return e.Prefixes(ctx, limit)
}

func (h *Handle) PromptPrefixes(req infer.Request) ([]int32, []uint64, error) {
	e := h.e.Load()
	if e == nil {
		return nil, nil, infer.ErrClosed
	}
	return e.PromptPrefixes(req)
}

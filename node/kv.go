package node

import (
	"bufio"
	"context"
	"errors"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/infernode/infernode/node/hop"
	"github.com/infernode/infernode/node/routing"
	"github.com/infernode/infernode/session/infer"
)

// Conversations' KV caches follow their ownership: a node pushes the caches it holds but
// does not own to their owners, when it leaves and when its ring changes (a join moved
// some conversations away), and takes the caches peers push to it.

// handleKV takes a conversation's KV frame pushed by a peer (POST hop.KVPath).
func (s *Server) handleKV(ctx *fasthttp.RequestCtx, replica bool) {
	if s.router == nil {
		writeError(ctx, errNotFound)
		return
	}
	body := ctx.PostBody()
	if err := s.router.Hop().Authenticate(inbound(ctx)); err != nil {
		writeError(ctx, err)
		return
	}
	start := time.Now()
	res, err := s.engine.Import(s.base, body, replica)
	s.router.ObserveKV("received", len(body), time.Since(start), err)
	if err != nil {
		s.log.Warn("KV frame refused", "from", string(ctx.Request.Header.Peek(hop.HeaderFrom)), "bytes", len(body), "err", err)
		writeError(ctx, err)
		return
	}
	s.log.Debug("KV taken", "from", string(ctx.Request.Header.Peek(hop.HeaderFrom)), "replica", replica, "tokens", res.Tokens,
		"bytes", len(body), "stall", res.Stall)
	writeJSON(ctx, fasthttp.StatusOK, res)
}

// handlePull answers a peer that joined lately and now owns a conversation with the
// conversation's KV frame (POST hop.PullPath, the key as body), unless it is not
// held here (404) or the peer would recompute it sooner (204). The copy here stays, as a
// replica.
func (s *Server) handlePull(ctx *fasthttp.RequestCtx) {
	if s.router == nil {
		writeError(ctx, errNotFound)
		return
	}
	if err := s.router.Hop().Authenticate(inbound(ctx)); err != nil {
		writeError(ctx, err)
		return
	}
	key, peer := string(ctx.PostBody()), string(ctx.Request.Header.Peek(hop.HeaderFrom))
	frame, err := s.engine.Snapshot(s.base, key)
	switch {
	case errors.Is(err, infer.ErrNotCached):
		s.log.Debug("KV pull: not held here", "by", peer, "session", key)
		ctx.SetStatusCode(fasthttp.StatusNotFound)
		return
	case err != nil:
		writeError(ctx, err)
		return
	case !s.router.WorthMoving(peer, frame.Len(), frame.Tokens()):
		frame.Release()
		s.log.Debug("KV pull: cheaper to recompute", "by", peer, "session", key, "tokens", frame.Tokens(), "bytes", frame.Len())
		ctx.SetStatusCode(fasthttp.StatusNoContent)
		return
	}
	s.log.Debug("KV pulled", "by", peer, "session", key, "tokens", frame.Tokens(), "bytes", frame.Len())
	ctx.SetContentType("application/octet-stream")
	start := time.Now()
	ctx.SetBodyStreamWriter(func(w *bufio.Writer) {
		defer frame.Release()
		_, err := frame.WriteTo(w)
		if err == nil {
			err = w.Flush()
		}
		s.router.ObserveKV("sent", frame.Len(), time.Since(start), err)
	})
	s.engine.Demote(s.base, key)
}

// HandOff pushes conversations cached here to their owners, most recently used first,
// until ctx ends: every one when leaving, else those another node owns now. It returns
// how many moved and how many could not.
func (s *Server) HandOff(ctx context.Context, leaving bool) (moved, failed int) {
	if s.router == nil {
		return 0, 0
	}
	keys, err := s.engine.Conversations(ctx)
	if err != nil {
		s.log.Warn("hand-off: cannot list conversations", "err", err)
		return 0, 0
	}
	start := time.Now()
	for _, key := range keys {
		if ctx.Err() != nil {
			failed++
			continue
		}
		if !leaving && s.router.Owns(key) {
			continue
		}
		why := routing.ToOwner
		if leaving {
			why = routing.Leaving
		}
		switch peer, err := s.push(ctx, key, why); {
		case errors.Is(err, infer.ErrNotCached): // running a turn, or evicted since: nothing to move
		case errors.Is(err, routing.ErrRecompute):
			s.log.Debug("hand-off: the owner recomputes it", "session", key, "err", err)
		case err != nil:
			failed++
			s.log.Warn("hand-off failed", "session", key, "sent to", peer, "err", err)
		default:
			moved++
			if !leaving {
				// Kept, as a replica: evicted first, and a copy if the owner fails.
				s.engine.Demote(ctx, key)
			}
		}
	}
	if moved+failed > 0 {
		s.log.Info("hand-off", "leaving", leaving, "moved", moved, "failed", failed, "took", time.Since(start).Round(time.Millisecond))
	}
	return moved, failed
}

// followRing hands conversations this node no longer owns to their new owners whenever
// its ring changes (a join, a return), once the ring has been quiet for settle.
func (s *Server) followRing(ctx context.Context, settle time.Duration) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.router.RingChanges():
		}
		for quiet := false; !quiet; {
			select {
			case <-ctx.Done():
				return
			case <-s.router.RingChanges():
			case <-time.After(settle):
				quiet = true
			}
		}
		s.HandOff(ctx, false)
	}
}

// keepWarm keeps a conversation's KV, after a turn served here, on the node that would
// serve its next turn if this one were gone: while this node drains, its owner once this
// node has left; otherwise (with replicas on) the node that takes over if this one dies,
// as a replica. It runs when the answer is complete but before its end reaches the client,
// so the next turn cannot overtake it; it adds no time to any token, only to the answer's
// last event (the push's own time: a replica is skipped when transfers are busy, and gives
// up after 2s).
func (s *Server) keepWarm(key string) {
	if s.router == nil || key == "" {
		return
	}
	why := routing.Replica
	switch {
	case s.isDraining():
		why = routing.Leaving
	case s.router.Replicas() == 0:
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	peers, err := s.push(ctx, key, why)
	if err != nil && !errors.Is(err, infer.ErrNotCached) && !errors.Is(err, routing.ErrBusy) &&
		!errors.Is(err, routing.ErrNoOwner) && !errors.Is(err, routing.ErrRecompute) {
		s.log.Debug("KV not pushed", "session", key, "sent to", peers, "err", err)
	}
}

// push exports a conversation and pushes it where why says, returning the peers it went
// to. ErrNotCached: nothing idle to copy (a next turn already runs, or it was evicted).
func (s *Server) push(ctx context.Context, key string, why routing.Push) ([]string, error) {
	frame, err := s.engine.Snapshot(ctx, key)
	if err != nil {
		return nil, err
	}
	defer frame.Release()
	return s.router.PushKV(ctx, key, frame, why)
}

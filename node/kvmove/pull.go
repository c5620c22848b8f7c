package kvmove

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/infernode/infernode/node/hop"
	"github.com/infernode/infernode/session/infer"
)

// Pulling on a miss: a node that joins (or comes back after a crash) owns conversations
// others served until then. They push them once their rings have been quiet for a moment
// (routing hands them on as its ring changes), and a busy conversation's next turn often comes sooner (the chaos suite
// saw 0 of 2 such turns warm). So for a while after it joined, the first turn of a
// conversation a node serves asks the node that would own it without this one, which
// served it until then, for its KV.

// PullWindow is how long after joining a node pulls: by then the old owners have pushed
// what they hold.
const PullWindow = 30 * time.Second

// pullTimeout bounds a pull; the turn waits for it. The old owner sends the frame only
// when it arrives sooner than the prefill it saves.
const pullTimeout = 10 * time.Second

// maxPulled bounds a pulled frame (a push's bound is the receiving node's MaxKVBytes).
const maxPulled = 256 << 20

// BeforeServe pulls req's conversation's KV from its previous owner when this node joined
// lately, owns the conversation and does not hold it (see previousOwner). A failed pull
// only means a cold start: the turn is served either way.
func (m *Mover) BeforeServe(ctx context.Context, req infer.Request) {
	if m.local.Holds(req.SessionID) {
		return
	}
	from, ok := m.previousOwner(req)
	if !ok {
		return
	}
	start := m.now()
	n, err := m.pull(ctx, from, req.SessionID)
	if n > 0 || err != nil {
		m.Observe("pulled", n, m.now().Sub(start), err)
	}
	m.log.Debug("KV pull", "session", req.SessionID, "from", from.ID, "bytes", n, "err", err)
}

// previousOwner is the node that owned req's conversation before this node joined (its
// heir: the owner on the ring without this node), if req continues an earlier answer (a
// new conversation has nothing to pull), this node joined within PullWindow and owns the
// conversation now. It is asked for the conversation's KV once.
func (m *Mover) previousOwner(req infer.Request) (Peer, bool) {
	key := req.SessionID
	if key == "" || !req.FollowUp {
		return Peer{}, false
	}
	if _, other := m.ring.Owner(key); other {
		return Peer{}, false
	}
	joined := m.ring.Joined()
	m.mu.Lock()
	asked := joined.IsZero() || m.pulled[key] || m.now().Sub(joined) > PullWindow
	if !asked {
		m.pulled[key] = true
	}
	m.mu.Unlock()
	if asked {
		return Peer{}, false
	}
	h := m.ring.Heirs(key, 1)
	if len(h) == 0 || h[0].Minor < hop.MinorSignedPull {
		return Peer{}, false // none, or one whose answer could not be verified
	}
	return h[0], true
}

// pull asks from for key's KV frame and installs it; it returns the frame's size (0:
// nothing was sent).
func (m *Mover) pull(ctx context.Context, from Peer, key string) (int, error) {
	ctx, cancel := context.WithTimeout(ctx, pullTimeout)
	defer cancel()
	body := []byte(key)
	req, err := http.NewRequestWithContext(ctx, "POST", hop.URL(from.Addr, hop.PullPath), bytes.NewReader(body))
	if err != nil {
		return 0, err
	}
	m.hop.Sign(req.Header.Set, "POST", hop.PullPath, from.ID, body)
	nonce := req.Header.Get(hop.HeaderNonce)
	resp, err := m.client.Do(req)
	if err != nil {
		return 0, fmt.Errorf("pull KV from %s: %w", from.ID, err)
	}
	defer resp.Body.Close()
	switch resp.StatusCode {
	case http.StatusOK:
	case http.StatusNotFound, http.StatusNoContent: // not held there, or cheaper to recompute
		return 0, nil
	default:
		return 0, fmt.Errorf("pull KV from %s: %w", from.ID, hop.DecodeError(resp))
	}
	frame, err := io.ReadAll(io.LimitReader(resp.Body, maxPulled+1))
	switch {
	case err != nil:
		return 0, fmt.Errorf("pull KV from %s: %w", from.ID, err)
	case len(frame) > maxPulled:
		return 0, fmt.Errorf("pull KV from %s: a frame over %d bytes", from.ID, maxPulled)
	}
	// The frame is installed only if the node asked signed it, for this pull, and it is of
	// the conversation asked for.
	if err := m.hop.VerifyAnswer(resp.Header.Get, hop.PullPath, from.ID, nonce, sha256.Sum256(frame)); err != nil {
		return len(frame), fmt.Errorf("pull KV from %s: %w", from.ID, err)
	}
	if _, err := m.local.Import(ctx, frame, infer.Pulled, key); err != nil {
		return len(frame), err
	}
	m.imports.WithLabelValues(string(infer.Pulled)).Inc()
	return len(frame), nil
}

// Take installs a frame a peer pushed (the receiving end of a push or a replica), which
// came as origin says.
func (m *Mover) Take(ctx context.Context, frame []byte, origin infer.Origin, from string) (infer.Imported, error) {
	start := m.now()
	res, err := m.local.Import(ctx, frame, origin, "")
	m.Observe("received", len(frame), m.now().Sub(start), err)
	if err != nil {
		m.log.Warn("KV frame refused", "from", from, "bytes", len(frame), "err", err)
		return res, err
	}
	m.imports.WithLabelValues(string(origin)).Inc()
	m.log.Debug("KV taken", "from", from, "origin", origin, "tokens", res.Tokens, "bytes", len(frame), "stall", res.Stall)
	return res, nil
}

// ErrNotHeld: a pull asked for a conversation not cached here.
var ErrNotHeld = errors.New("conversation not held here")

// Give answers a pull from peer (the receiving end of one), whose hop had nonce: key's
// frame, to be written and then released, with the answer's signature set by sign;
// ErrNotHeld; or ErrRecompute when peer would prefill it sooner. The copy here stays, as a
// replica.
func (m *Mover) Give(ctx context.Context, key, peer, nonce string, sign func(name, value string)) (infer.Frame, error) {
	frame, err := m.local.Snapshot(ctx, key)
	switch {
	case errors.Is(err, infer.ErrNotCached):
		m.log.Debug("KV pull: not held here", "by", peer, "session", key)
		return nil, ErrNotHeld
	case err != nil:
		return nil, err
	case !m.WorthMoving(peer, frame.Len(), frame.Tokens()):
		frame.Release()
		m.log.Debug("KV pull: cheaper to recompute", "by", peer, "session", key, "tokens", frame.Tokens(), "bytes", frame.Len())
		return nil, ErrRecompute
	}
	hash := sha256.New()
	if _, err := frame.WriteTo(hash); err != nil {
		frame.Release()
		return nil, err
	}
	m.hop.SignAnswer(sign, hop.PullPath, peer, nonce, [32]byte(hash.Sum(nil)))
	m.log.Debug("KV pulled", "by", peer, "session", key, "tokens", frame.Tokens(), "bytes", frame.Len())
	m.local.Demote(ctx, key)
	return given{frame, m}, nil
}

// given is a frame answering a pull: writing it (and flushing a writer that buffers)
// counts as a transfer sent.
type given struct {
	infer.Frame
	m *Mover
}

func (g given) WriteTo(w io.Writer) (int64, error) {
	start := g.m.now()
	n, err := g.Frame.WriteTo(w)
	if f, ok := w.(interface{ Flush() error }); ok && err == nil {
		err = f.Flush()
	}
	g.m.Observe("sent", g.Frame.Len(), g.m.now().Sub(start), err)
	return n, err
}

package kvmove

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"hash"
	"io"
	"maps"
	"net/http"
	"slices"
	"strconv"
	"time"

	"github.com/infernode/infernode/node/hop"
	"github.com/infernode/infernode/session/infer"
)

// Pulling on a miss: a node that joins (or comes back after a crash) owns conversations
// others served until then. They push them once their rings have been quiet for a moment
// (routing hands them on as its ring changes), and a busy conversation's next turn often
// comes sooner (the chaos suite saw 0 of 2 such turns warm). So for a while after it
// joined, the first turn of a conversation a node serves asks the node that would own it
// without this one, which served it until then, for its KV.
//
// A node that leaves gracefully is off every ring at once, while it drains and hands its
// caches off: a conversation's next turn can reach its heir before the push (the chaos
// suite's leave-join saw 1 in 10 cold under make test's load). So a node also asks the
// members that left lately for a conversation it does not hold.

// PullWindow is how long after joining a node pulls: by then the old owners have pushed
// what they hold.
const PullWindow = 30 * time.Second

// pullTimeout bounds a pull, unless the caller knows it saves a longer prefill (see
// Fetch); the turn waits for it. The old owner sends the frame only when it arrives
// sooner than the prefill it saves. (A variable for tests.)
var pullTimeout = 10 * time.Second

// maxPulled bounds a pulled frame (a push's bound is the receiving node's MaxKVBytes).
const maxPulled = 256 << 20

// BeforeServe pulls req's conversation's KV from where it was served before when this
// node does not hold it (see previousOwners): the first that has it sends it. A failed
// pull only means a cold start: the turn is served either way.
func (m *Mover) BeforeServe(ctx context.Context, req infer.Request) {
	if m.local.Holds(req.SessionID) {
		return
	}
	for _, from := range m.previousOwners(req) {
		if n, err := m.Fetch(ctx, from, req.SessionID, infer.Pulled, 0); n > 0 && err == nil {
			return
		}
	}
}

// previousOwners are the nodes that may hold req's conversation's KV when it continues an
// earlier answer (a new conversation has nothing to pull): the members that left lately,
// and, when this node joined within PullWindow and owns the conversation now, the node
// that owned it before (its heir: the owner on the ring without this node). Only peers
// whose answer can be verified are asked, and a conversation is asked for at most once in
// PullWindow.
func (m *Mover) previousOwners(req infer.Request) []Peer {
	key := req.SessionID
	if key == "" || !req.FollowUp {
		return nil
	}
	from := m.ring.Leavers()
	if _, other := m.ring.Owner(key); !other {
		if joined := m.ring.Joined(); !joined.IsZero() && m.now().Sub(joined) <= PullWindow {
			from = append(from, m.ring.Heirs(key, 1)...)
		}
	}
	from = slices.DeleteFunc(from, func(p Peer) bool { return p.Minor < hop.MinorSignedPull })
	if len(from) == 0 {
		return nil
	}
	now := m.now()
	m.mu.Lock()
	defer m.mu.Unlock()
	if at, ok := m.pulled[key]; ok && now.Sub(at) < PullWindow {
		return nil
	}
	if len(m.pulled) >= 1024 {
		maps.DeleteFunc(m.pulled, func(_ string, at time.Time) bool { return now.Sub(at) >= PullWindow })
	}
	m.pulled[key] = now
	return from
}

// Fetch asks from for key's KV frame and installs it, as having come as origin says; it
// returns the frame's size (0: nothing was sent: not held there, or cheaper to
// recompute). It gives up after pullTimeout, or twice saves when longer: the prefill the
// frame saves, as far as the caller knows (a long prompt's frame on a slow link takes
// longer than pullTimeout and still arrives well before its prefill would end).
func (m *Mover) Fetch(ctx context.Context, from Peer, key string, origin infer.Origin, saves time.Duration) (int, error) {
	start := m.now()
	ctx, cancel := context.WithTimeout(ctx, max(pullTimeout, 2*saves))
	defer cancel()
	n, err := m.pull(ctx, from, key, origin)
	took := m.now().Sub(start)
	if n > 0 || err != nil {
		m.Observe("pulled", n, took, err)
	}
	if err == nil {
		m.learnRate(from.ID, n, took)
	}
	m.log.Debug("KV pull", "session", key, "from", from.ID, "origin", origin, "bytes", n, "err", err)
	return n, err
}

func (m *Mover) pull(ctx context.Context, from Peer, key string, origin infer.Origin) (int, error) {
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
	buf := m.pullBufs.Get()
	defer m.pullBufs.Put(buf)
	h := hop.HashFor(resp.Header.Get)
	frame, err := m.readFrame(resp, buf, h)
	*buf = frame[:0]
	switch {
	case err != nil:
		return 0, fmt.Errorf("pull KV from %s: %w", from.ID, err)
	case len(frame) > maxPulled:
		return 0, fmt.Errorf("pull KV from %s: a frame over %d bytes", from.ID, maxPulled)
	}
	// The frame is installed only if the node asked signed it, for this pull, and it is of
	// the conversation asked for.
	if err := m.hop.VerifyAnswerSum(resp.Header.Get, hop.PullPath, from.ID, nonce, hop.SumFrom(h)); err != nil {
		return len(frame), fmt.Errorf("pull KV from %s: %w", from.ID, err)
	}
	res, err := m.local.Import(ctx, frame, origin, key)
	if err != nil {
		return len(frame), err
	}
	m.learnSize(len(frame), res.Tokens)
	m.imports.WithLabelValues(string(origin)).Inc()
	return len(frame), nil
}

// readFrame reads a pull's answer into buf, writing it to h as it arrives: the size the
// answer declares (up to maxPulled), else growing it as io.ReadAll does, up to one byte
// past maxPulled.
func (m *Mover) readFrame(resp *http.Response, buf *[]byte, h hash.Hash) ([]byte, error) {
	n, err := strconv.Atoi(resp.Header.Get(hop.HeaderFrameBytes))
	if err != nil || n < 0 || n > maxPulled {
		b := bytes.NewBuffer((*buf)[:0])
		_, err := b.ReadFrom(io.TeeReader(io.LimitReader(resp.Body, maxPulled+1), h))
		return b.Bytes(), err
	}
	frame := m.pullBufs.Sized(buf, n)
	if err := hop.ReadHashing(resp.Body, frame, h); err != nil {
		return frame[:0], err
	}
	return frame, nil
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

// Give answers a pull from peer (the receiving end of one), whose hop had nonce and hop
// minor version minor: key's frame, to be written and then released, with the answer's
// signature set by sign; ErrNotHeld; or ErrRecompute when peer would prefill it sooner.
// The copy here stays, as a replica.
func (m *Mover) Give(ctx context.Context, key, peer, nonce string, minor int, sign func(name, value string)) (infer.Frame, error) {
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
	hash := hop.NewHash(minor >= hop.MinorBLAKE3)
	if _, err := frame.WriteTo(hash); err != nil {
		frame.Release()
		return nil, err
	}
	m.hop.SignAnswer(sign, hop.PullPath, peer, nonce, hop.SumFrom(hash))
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

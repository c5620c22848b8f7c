package routing

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/time/rate"

	"github.com/infernode/infernode/node/hop"
	"github.com/infernode/infernode/ring"
	"github.com/infernode/infernode/session/infer"
)

// Moving conversations' KV caches to their owners: a node that holds a conversation it
// does not own (it is leaving, or a join moved the conversation) pushes the cache, as a KV
// frame, to the conversation's owner over the authenticated hop (hop.KVPath).

// ErrNoOwner: no other node is on the ring to take a conversation.
var ErrNoOwner = errors.New("no other owner on the ring")

// kvMetrics count transfers by direction and outcome.
type kvMetrics struct {
	transfers *prometheus.CounterVec
	bytes     *prometheus.CounterVec
	seconds   *prometheus.CounterVec
}

func newKVMetrics() kvMetrics {
	return kvMetrics{
		transfers: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "infernode_kv_transfers_total", Help: "Conversation KV caches pushed to (sent) or taken from (received) peers, by outcome.",
		}, []string{"direction", "outcome"}),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "infernode_kv_transfer_bytes_total", Help: "Bytes of KV frames transferred successfully.",
		}, []string{"direction"}),
		seconds: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "infernode_kv_transfer_seconds_total", Help: "Time spent transferring KV frames successfully.",
		}, []string{"direction"}),
	}
}

// ObserveKV records a transfer this node took part in (direction "sent" or "received").
func (r *Router) ObserveKV(direction string, size int, took time.Duration, err error) {
	outcome := "ok"
	if err != nil {
		outcome = "refused"
	}
	r.kv.transfers.WithLabelValues(direction, outcome).Inc()
	if err == nil {
		r.kv.bytes.WithLabelValues(direction).Add(float64(size))
		r.kv.seconds.WithLabelValues(direction).Add(took.Seconds())
	}
}

// Owns reports whether this node is key's owner on its ring (an empty ring: it serves
// everything itself).
func (r *Router) Owns(key string) bool {
	c := r.candidates("", key)
	return len(c) == 0 || c[0].id == r.cfg.Self
}

// maxReplicas bounds Config.Replicas: every replica is a whole copy of the state.
const maxReplicas = 3

// heirs are up to n members that would own key in turn once the nodes gone (by default
// this one) have left or failed: the owner on this node's ring without them, then the
// owner without that one too, and so on. (Not simply the next ones of Owners: the ring
// reassigns a leaving member's partitions by load, not by successor.)
func (r *Router) heirs(key string, n int, gone ...string) []candidate {
	if len(gone) == 0 {
		gone = []string{r.cfg.Self}
	}
	base := r.table.Ring()
	gone = slices.Clone(gone)
	var ids []string
	for len(ids) < n {
		id, ok := r.ringWithout(base, gone).Owner(key)
		if !ok {
			break
		}
		ids, gone = append(ids, id), append(gone, id)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]candidate, len(ids))
	for i, id := range ids {
		out[i] = candidate{id: id, addr: r.members[id].Meta.HTTPAddr}
	}
	return out
}

// Push says why a conversation's KV is pushed, and so to whom.
type Push int

const (
	// ToOwner: the conversation's owner on this node's ring is another node now.
	ToOwner Push = iota
	// Leaving: this node is leaving; its owner once this node has left takes it.
	Leaving
	// Replica: copies for the Config.Replicas nodes that would take the conversation over
	// if this one failed. Best effort: skipped when transfers are busy.
	Replica
)

var (
	// ErrBusy: a replica was skipped because Config.KVTransfers pushes were running.
	ErrBusy = errors.New("KV transfers busy")
	// ErrRecompute: the destination would prefill the conversation's tokens sooner than
	// the transfer would bring them (see Config.KVMargin), so it was not sent.
	ErrRecompute = errors.New("recomputing the KV is cheaper than transferring it")
)

// Replicas is how many peers keep a copy of each conversation served here.
func (r *Router) Replicas() int { return r.cfg.Replicas }

// PushKV sends a conversation's KV frame where why says and returns the
// peers it went to. At most Config.KVTransfers pushes run at once and together they keep
// within Config.KVBandwidth, so transfers never take every connection, core or the link
// from serving. A peer that would recompute the tokens sooner than the transfer would
// take is skipped (ErrRecompute).
func (r *Router) PushKV(ctx context.Context, key string, frame infer.Frame, why Push) ([]string, error) {
	var to []candidate
	switch why {
	case ToOwner:
		if cands := r.candidates("", key); len(cands) > 0 && cands[0].id != r.cfg.Self {
			to = cands[:1]
		}
	case Leaving:
		to = r.heirs(key, 1)
	case Replica:
		to = r.heirs(key, r.cfg.Replicas)
	}
	if len(to) == 0 {
		return nil, ErrNoOwner
	}
	var sent []string
	var errs []error
	for _, c := range to {
		if err := r.pushTo(ctx, c, frame, why); err != nil {
			errs = append(errs, err)
			continue
		}
		sent = append(sent, c.id)
	}
	return sent, errors.Join(errs...)
}

func (r *Router) pushTo(ctx context.Context, to candidate, frame infer.Frame, why Push) error {
	if transfer, recompute, ok := r.worthMoving(to.id, frame.Len(), frame.Tokens()); !ok {
		return fmt.Errorf("%w: to %s, %d tokens: transfer %v, prefill %v", ErrRecompute, to.id, frame.Tokens(),
			transfer.Round(time.Millisecond), recompute.Round(time.Millisecond))
	}
	select {
	case r.kvSlots <- struct{}{}:
	default:
		if why == Replica {
			r.kv.transfers.WithLabelValues("sent", "skipped").Inc()
			return fmt.Errorf("%w: replica for %s skipped", ErrBusy, to.id)
		}
		select {
		case r.kvSlots <- struct{}{}:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	defer func() { <-r.kvSlots }()
	path := hop.KVPath
	if why == Replica {
		path = hop.ReplicaPath
	}
	start := r.clock.Now()
	err := r.sendKV(ctx, to, path, frame)
	took := r.clock.Now().Sub(start)
	r.ObserveKV("sent", frame.Len(), took, err)
	if err == nil && why != Replica {
		r.happened("handoff", to.id, fmt.Sprintf("%d tokens, %d KiB, %v", frame.Tokens(), frame.Len()>>10, took.Round(time.Millisecond)))
	}
	if err == nil && frame.Len() >= minRateSample && took > 0 {
		r.mu.Lock()
		rate := float64(frame.Len()) / took.Seconds()
		if old := r.kvRates[to.id]; old > 0 {
			rate = old + (rate-old)/rateWindow
		}
		r.kvRates[to.id] = rate
		r.mu.Unlock()
	}
	return err
}

// A peer's transfer rate (Router.kvRates) averages pushes of at least minRateSample
// bytes (smaller ones time the round trip and the import, not the link), over about
// rateWindow of them.
const (
	minRateSample = 1 << 20
	rateWindow    = 4
)

// worthMoving estimates how long sending size bytes to peer would take (from past pushes
// to it, and the bandwidth bound) and how long the peer would take to prefill tokens
// (from the rate it gossips; one that has prefilled nothing yet, such as a node that just
// joined, is taken to prefill as fast as this node: it serves the same model), and says
// whether the transfer wins by Config.KVMargin, counting a decision against as a
// recompute. Either unknown: move it (and so learn the transfer rate).
func (r *Router) worthMoving(peer string, size, tokens int) (transfer, recompute time.Duration, ok bool) {
	r.mu.Lock()
	bw, prefill := r.kvRates[peer], float64(r.members[peer].Meta.Prefill)
	r.mu.Unlock()
	if prefill == 0 && r.local != nil {
		prefill = r.local.Stats().PrefillRate
	}
	if r.kvLimit != nil && (bw == 0 || float64(r.kvLimit.Limit()) < bw) {
		bw = float64(r.kvLimit.Limit())
	}
	if bw == 0 || prefill == 0 {
		return 0, 0, true
	}
	transfer = time.Duration(float64(size) / bw * float64(time.Second))
	recompute = time.Duration(float64(tokens) / prefill * float64(time.Second))
	ok = float64(transfer)*r.cfg.KVMargin < float64(recompute)
	if !ok {
		r.kv.transfers.WithLabelValues("sent", "recompute").Inc()
	}
	return transfer, recompute, ok
}

// kvChunk is the most of a frame sent at once under the bandwidth bound.
const kvChunk = 64 << 10

// newKVLimit paces KV pushes to mbit megabits a second (nil: unbounded), in bursts of a
// tenth of a second's worth (at most 1 MiB) beyond a chunk.
func newKVLimit(mbit float64) *rate.Limiter {
	if mbit <= 0 {
		return nil
	}
	bytes := mbit * 1e6 / 8
	return rate.NewLimiter(rate.Limit(bytes), int(min(bytes/10, 1<<20))+kvChunk)
}

// paced reads a frame no faster than the router's KV bandwidth allows.
type paced struct {
	ctx   context.Context
	r     io.Reader
	limit *rate.Limiter
}

func (p *paced) Read(b []byte) (int, error) {
	n, err := p.r.Read(b[:min(len(b), kvChunk)])
	if n > 0 {
		if werr := p.limit.WaitN(p.ctx, n); werr != nil {
			return n, werr
		}
	}
	return n, err
}

// sendKV posts frame to c: written once to hash it for the signature, then again into
// the request's body as the transport reads it, so the frame is never held whole.
func (r *Router) sendKV(ctx context.Context, c candidate, path string, frame infer.Frame) error {
	ctx, cancel := context.WithTimeout(ctx, r.cfg.KVTimeout)
	defer cancel()
	hash := sha256.New()
	if _, err := frame.WriteTo(hash); err != nil {
		return err
	}
	pr, pw := io.Pipe()
	written := make(chan struct{})
	go func() {
		defer close(written)
		_, err := frame.WriteTo(pw)
		pw.CloseWithError(err)
	}()
	defer func() { pr.Close(); <-written }() // the frame is the caller's again once this returns
	var body io.Reader = pr
	if r.kvLimit != nil {
		body = &paced{ctx: ctx, r: body, limit: r.kvLimit}
	}
	req, err := http.NewRequestWithContext(ctx, "POST", peerURL(c.addr, path), body)
	if err != nil {
		return err
	}
	req.ContentLength = int64(frame.Len())
	req.Header.Set("Content-Type", "application/octet-stream")
	r.hop.SignHash(req.Header.Set, "POST", path, c.id, [32]byte(hash.Sum(nil)))
	resp, err := r.client.Do(req)
	if err != nil {
		return fmt.Errorf("push KV to %s: %w", c.id, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("push KV to %s: %w", c.id, hop.DecodeError(resp))
	}
	return nil
}

// Pulling on a miss: a node that joins (or comes back after a crash) owns conversations
// others served until then. They push them once their rings have been quiet for a moment
// (node.followRing), and a busy conversation's next turn often comes sooner (the chaos
// suite saw 0 of 2 such turns warm). So for a while after it joined, the first turn of a
// conversation a node serves asks the node that would own it without this one, which
// served it until then, for its KV.

// pullWindow is how long after joining a node pulls: by then the old owners have pushed
// what they hold.
const pullWindow = 30 * time.Second

// pullTimeout bounds a pull; the turn waits for it. The old owner sends the frame only
// when it arrives sooner than the prefill it saves.
const pullTimeout = 10 * time.Second

// maxPulled bounds a pulled frame (a push's bound is the receiving node's MaxKVBytes).
const maxPulled = 256 << 20

// importer is what the router needs of the local engine to pull a conversation it does
// not hold (session.Handle has it).
type importer interface {
	Import(ctx context.Context, frame []byte, replica bool) (infer.Imported, error)
	Holds(key string) bool
}

// previousOwner is the node that owned req's conversation before this node joined (its
// heir: the owner on the ring without this node), if req continues an earlier answer (a
// new conversation has nothing to pull), this node joined within pullWindow and owns the
// conversation now. It is asked for the conversation's KV once.
func (r *Router) previousOwner(req infer.Request) (candidate, bool) {
	key := req.SessionID
	if key == "" || !req.FollowUp || !r.Owns(key) {
		return candidate{}, false
	}
	r.mu.Lock()
	asked := r.joined.IsZero() || r.pulled[key] || r.clock.Now().Sub(r.joined) > pullWindow
	if !asked {
		r.pulled[key] = true
	}
	r.mu.Unlock()
	if asked {
		return candidate{}, false
	}
	h := r.heirs(key, 1)
	if len(h) == 0 {
		return candidate{}, false
	}
	return h[0], true
}

// ServeLocal serves req on this node's engine, first pulling its conversation's KV from
// its previous owner when this node joined lately and does not hold it (see
// previousOwner). A failed pull only means a cold start.
func (r *Router) ServeLocal(ctx context.Context, req infer.Request) (infer.Stream, error) {
	if imp, ok := r.local.(importer); ok && !imp.Holds(req.SessionID) {
		if from, ok := r.previousOwner(req); ok {
			start := r.clock.Now()
			n, err := r.pull(ctx, from, req.SessionID, imp)
			if n > 0 || err != nil {
				r.ObserveKV("pulled", n, r.clock.Now().Sub(start), err)
			}
			r.log.Debug("KV pull", "session", req.SessionID, "from", from.id, "bytes", n, "err", err)
		}
	}
	return r.local.Submit(ctx, req)
}

// pull asks from for key's KV frame and installs it; it returns the frame's size (0:
// nothing was sent).
func (r *Router) pull(ctx context.Context, from candidate, key string, imp importer) (int, error) {
	ctx, cancel := context.WithTimeout(ctx, pullTimeout)
	defer cancel()
	body := []byte(key)
	req, err := http.NewRequestWithContext(ctx, "POST", peerURL(from.addr, hop.PullPath), bytes.NewReader(body))
	if err != nil {
		return 0, err
	}
	r.hop.Sign(req.Header.Set, "POST", hop.PullPath, from.id, body)
	resp, err := r.client.Do(req)
	if err != nil {
		return 0, fmt.Errorf("pull KV from %s: %w", from.id, err)
	}
	defer resp.Body.Close()
	switch resp.StatusCode {
	case http.StatusOK:
	case http.StatusNotFound, http.StatusNoContent: // not held there, or cheaper to recompute
		return 0, nil
	default:
		return 0, fmt.Errorf("pull KV from %s: %w", from.id, hop.DecodeError(resp))
	}
	frame, err := io.ReadAll(io.LimitReader(resp.Body, maxPulled+1))
	switch {
	case err != nil:
		return 0, fmt.Errorf("pull KV from %s: %w", from.id, err)
	case len(frame) > maxPulled:
		return 0, fmt.Errorf("pull KV from %s: a frame over %d bytes", from.id, maxPulled)
	}
	if _, err := imp.Import(ctx, frame, false); err != nil {
		return len(frame), err
	}
	return len(frame), nil
}

// WorthMoving says whether sending a frame of size bytes holding tokens to peer beats
// its prefill (see worthMoving).
func (r *Router) WorthMoving(peer string, size, tokens int) bool {
	_, _, ok := r.worthMoving(peer, size, tokens)
	return ok
}

// ringWithout is base without the members gone, cached with the other heirs' rings (one
// Apply at 1,000 peers costs milliseconds: see docs/SCALE.md).
func (r *Router) ringWithout(base *ring.Ring, gone []string) *ring.Ring {
	k := heirKey{base, strings.Join(gone, "\x00")}
	r.heirMu.Lock()
	defer r.heirMu.Unlock()
	rg := r.heirRings[k]
	if rg == nil {
		if len(r.heirRings) >= 4*maxReplicas || r.heirRings == nil {
			r.heirRings = map[heirKey]*ring.Ring{} // most are of rings that have changed since
		}
		rg = base.Apply(nil, gone)
		r.heirRings[k] = rg
	}
	return rg
}

type heirKey struct {
	base *ring.Ring
	gone string
}

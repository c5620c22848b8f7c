package routing

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/infernode/infernode/ring"
)

// Moving conversations' KV caches to their owners: a node that holds a conversation it
// does not own (it is leaving, or a join moved the conversation) pushes the cache, as a KV
// frame, to the conversation's owner over the authenticated hop (KVPath).

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
	c := r.candidates(key)
	return len(c) == 0 || c[0].id == r.cfg.Self
}

// heir is the peer that owns key on this node's ring without this node: where its
// conversations belong once it has left. (Not simply the next of Owners: the ring
// reassigns a leaving member's partitions by load, not by successor.)
func (r *Router) heir(key string) (candidate, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	members := slices.DeleteFunc(r.table.Ring().Members(), func(id string) bool { return id == r.cfg.Self })
	if r.heirs == nil || !slices.Equal(r.heirs.Members(), members) {
		r.heirs = ring.New(r.cfg.Ring, members)
	}
	id, ok := r.heirs.Owner(key)
	return candidate{id: id, addr: r.members[id].Meta.HTTPAddr}, ok
}

// Push says why a conversation's KV is pushed, and so to whom.
type Push int

const (
	// ToOwner: the conversation's owner on this node's ring is another node now.
	ToOwner Push = iota
	// Leaving: this node is leaving; its owner once this node has left takes it.
	Leaving
	// Replica: a copy for the node that would take the conversation over if this one
	// failed. Best effort: skipped when transfers are busy.
	Replica
)

// ErrBusy: a replica was skipped because Config.KVTransfers pushes were running.
var ErrBusy = errors.New("KV transfers busy")

// PushKV sends a conversation's KV frame where why says and returns that peer's id. At
// most Config.KVTransfers pushes run at once, so transfers never take every connection
// and core from serving.
func (r *Router) PushKV(ctx context.Context, key string, frame []byte, why Push) (string, error) {
	var to candidate
	var ok bool
	if why == ToOwner {
		cands := r.candidates(key)
		if ok = len(cands) > 0 && cands[0].id != r.cfg.Self; ok {
			to = cands[0]
		}
	} else {
		to, ok = r.heir(key)
	}
	if !ok {
		return "", ErrNoOwner
	}
	select {
	case r.kvSlots <- struct{}{}:
	default:
		if why == Replica {
			r.kv.transfers.WithLabelValues("sent", "skipped").Inc()
			return to.id, ErrBusy
		}
		select {
		case r.kvSlots <- struct{}{}:
		case <-ctx.Done():
			return to.id, ctx.Err()
		}
	}
	defer func() { <-r.kvSlots }()
	path := KVPath
	if why == Replica {
		path = ReplicaPath
	}
	start := r.clock.Now()
	err := r.sendKV(ctx, to, path, frame)
	r.ObserveKV("sent", len(frame), r.clock.Now().Sub(start), err)
	return to.id, err
}

func (r *Router) sendKV(ctx context.Context, c candidate, path string, frame []byte) error {
	ctx, cancel := context.WithTimeout(ctx, r.cfg.KVTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, "POST", peerURL(c.addr, path), bytes.NewReader(frame))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/octet-stream")
	r.auth.sign(req.Header.Set, "POST", path, r.cfg.Self, c.id, frame)
	resp, err := r.client.Do(req)
	if err != nil {
		return fmt.Errorf("push KV to %s: %w", c.id, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("push KV to %s: %w", c.id, decodeError(resp))
	}
	return nil
}

package kvmove

import (
	"context"
	"errors"
	"time"

	"github.com/infernode/infernode/session/infer"
)

// The hand-off policy: a conversation's KV follows its ownership. A node pushes the caches
// it holds but does not own to their owners when it leaves and when its ring changes (a
// join moved some conversations away), and after each turn it serves keeps a copy where
// the next turn would go if it were gone.

// HandOff pushes conversations cached here to their owners, most recently used first,
// until ctx ends: every one when leaving (but those a leaving push has moved already),
// else those another node owns now. It returns how many moved and how many could not.
func (m *Mover) HandOff(ctx context.Context, leaving bool) (moved, failed int) {
	keys, err := m.local.Conversations(ctx)
	if err != nil {
		m.log.Warn("hand-off: cannot list conversations", "err", err)
		return 0, 0
	}
	start := time.Now()
	for _, key := range keys {
		if ctx.Err() != nil {
			failed++
			continue
		}
		why := Leaving
		if leaving && m.handedOff(key) {
			continue
		}
		if !leaving {
			if owner, other := m.ring.Owner(key); !other || m.placedAway(key, owner.ID) {
				continue
			}
			why = ToOwner
		}
		switch peer, err := m.Push(ctx, key, why); {
		case errors.Is(err, infer.ErrNotCached): // running a turn, or evicted since: nothing to move
		case errors.Is(err, ErrNoOwner): // the ring's last node: no one to move it to
		case errors.Is(err, ErrRecompute):
			m.log.Debug("hand-off: the owner recomputes it", "session", key, "err", err)
		case err != nil:
			failed++
			m.log.Warn("hand-off failed", "session", key, "sent to", peer, "err", err)
		default:
			moved++
			if !leaving {
				// Kept, as a replica: evicted first, and a copy if the owner fails.
				m.local.Demote(ctx, key)
			}
		}
	}
	if moved+failed > 0 {
		m.log.Info("hand-off", "leaving", leaving, "moved", moved, "failed", failed, "took", time.Since(start).Round(time.Millisecond))
	}
	return moved, failed
}

// maxRemembered bounds the conversations Away and Replicas remember: past it, they are
// forgotten (a conversation served away is handed to its owner on the next ring change, as
// before placement; one whose replicas are forgotten is not placed on them).
const maxRemembered = 1 << 16

// Away records that conversation key is served here though owner owns it on the ring: it
// was placed here (a load-aware owner declined it). HandOff leaves it here while that
// node owns it still: a ring change elsewhere does not undo the placement.
func (m *Mover) Away(key, owner string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.away) >= maxRemembered {
		clear(m.away)
	}
	m.away[key] = owner
}

// placedAway reports whether key's conversation was served here while owner owned it.
func (m *Mover) placedAway(key, owner string) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.away[key] == owner
}

// KeepWarm keeps a conversation's KV, after a turn served here, on the node that would
// serve its next turn if this one were gone. While this node drains that is its owner
// once this node has left, and the push is done before KeepWarm returns: it runs when the
// answer is complete but before its end reaches the client, so the next turn, sent to that
// owner, cannot overtake it. Otherwise (with replicas on) the copy goes to the nodes that
// take over if this one dies, as replicas, in the background: the next turn runs here, on
// the cells the replica copies, so nothing waits for it (a push before the answer's end
// held every stream's last event 150 ms at the median under load, see
// docs/BENCHMARKS.md). Only a death before it lands finds the replica a turn behind, still
// a prefix of the conversation; a next turn that starts first leaves it so too (the
// snapshot finds the conversation running). A replica is skipped when Config.Transfers
// are warming already, and gives up after 2s.
func (m *Mover) KeepWarm(key string, draining bool) {
	switch {
	case key == "":
	case draining:
		m.keepWarm(key, Leaving)
	case m.cfg.Replicas == 0:
	default:
		select {
		case m.warming <- struct{}{}:
		default:
			m.transfers.WithLabelValues("sent", "skipped").Inc()
			return
		}
		go func() {
			defer func() { <-m.warming }()
			m.keepWarm(key, Replica)
		}()
	}
}

// keepWarm pushes key's conversation as why says, within 2s, and logs a failure other
// than one of those KeepWarm expects (nothing idle to copy, busy, no heir, cheaper to
// recompute).
func (m *Mover) keepWarm(key string, why Why) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	peers, err := m.Push(ctx, key, why)
	if err != nil && !errors.Is(err, infer.ErrNotCached) && !errors.Is(err, ErrBusy) &&
		!errors.Is(err, ErrNoOwner) && !errors.Is(err, ErrRecompute) {
		m.log.Debug("KV not pushed", "session", key, "sent to", peers, "err", err)
	}
}

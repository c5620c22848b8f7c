package routing

import (
	"time"

	"github.com/infernode/infernode/node/gray"
)

// Gray failures (see the gray package): the router feeds its detector what it observes
// of its peers' speed, gossips its verdicts, and computes the cluster's from everyone's.

// observeProbe records a successful probe's round trip.
func (r *Router) observeProbe(peer string, rtt time.Duration) {
	r.speedMu.Lock()
	defer r.speedMu.Unlock()
	r.speed.Probe(peer, rtt)
}

// observeGap records the time between two tokens of an answer forwarded to peer.
func (r *Router) observeGap(peer string, gap time.Duration) {
	r.speedMu.Lock()
	defer r.speedMu.Unlock()
	r.speed.Gap(peer, gap, r.clock.Now())
}

// judgeSpeeds compares the peers' speeds after a probe round (live lists the peers that
// count) and reports whether this node's verdict on any of them changed.
func (r *Router) judgeSpeeds(live []string) bool {
	r.speedMu.Lock()
	changes := r.speed.Judge(live, r.clock.Now())
	r.speedMu.Unlock()
	for _, c := range changes {
		r.log.Info("peer speed verdict changed", "peer", c.Peer, "slow", c.Slow,
			"probe_ms", c.ProbeMS, "probe_base_ms", c.ProbeBaseMS, "gap_ms", c.GapMS, "gap_base_ms", c.GapBaseMS)
	}
	return len(changes) > 0
}

// slowPeers lists the peers this node finds slow, to gossip.
func (r *Router) slowPeers() []string {
	r.speedMu.Lock()
	defer r.speedMu.Unlock()
	return r.speed.Slow()
}

// speedOf is what this node observes of a peer's speed.
func (r *Router) speedOf(peer string) gray.Speed {
	r.speedMu.Lock()
	defer r.speedMu.Unlock()
	return r.speed.Speed(peer)
}

// updateDegraded recomputes the cluster's verdict from gossip, and when it changed, says
// so and signals a ring change (conversations move). Callers hold mu.
func (r *Router) updateDegraded() {
	var others []gray.Observer
	for _, m := range r.members {
		if serving(m) {
			others = append(others, gray.Observer{ID: m.Meta.ID, Slow: m.Meta.Slow})
		}
	}
	next := gray.Degraded(r.slowPeers(), others)
	for id := range next {
		if !r.degraded[id] {
			r.log.Warn("member degraded: it keeps a reduced share of conversations", "member", id, "share", r.cfg.Gray.Share)
			r.happened("degraded", id, "")
		}
	}
	for id := range r.degraded {
		if !next[id] {
			r.log.Info("member restored", "member", id)
			r.happened("restored", id, "")
		}
	}
	if len(next) != len(r.degraded) || !sameKeys(next, r.degraded) {
		r.degraded = next
		select {
		case r.ringCh <- struct{}{}:
		default:
		}
	}
}

func sameKeys(a, b map[string]bool) bool {
	for k := range a {
		if !b[k] {
			return false
		}
	}
	return len(a) == len(b)
}

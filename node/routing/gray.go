package routing

import (
	"hash/fnv"
	"math"
	"slices"
	"sync"
	"time"
)

// Gray failures: a peer that answers its checks, so it stays healthy on every ring, but
// answers slowly (starved of CPU, throttled, behind one bad link). Health checks cannot
// see it; comparing peers can.
//
// Each node keeps, for every peer, moving averages of what it observes of it: the round
// trip of its probes, and the gaps between the tokens of answers forwarded to it. A peer
// whose average is an outlier against the others' (more than GrayFactor times their lower
// median, and GrayFloor more) for GrayEnter probe rounds more than it is not is slow in
// this node's eyes, and stops being so after GrayExit such rounds back under half that
// margin (hysteresis). Each node gossips the peers it finds slow; a member is degraded when more
// than half of the members that observe it say so, a verdict every node computes alike
// from gossip. A degraded node keeps DegradedShare of the conversations it owns on the
// ring (those whose key hashes below the share); the others go to their next owner while
// it is degraded, their KV handed over by the degraded node as on a ring change. It stays
// on every ring: a slow node must not become a dead one.

// grayAlpha weighs a new observation in a peer's moving averages: about the last 5
// observations count.
const grayAlpha = 0.3

// maxSlowListed bounds the peers one node gossips as slow (metadata is 512 bytes).
const maxSlowListed = 8

type ewma struct {
	v float64
	n int
}

func (e *ewma) add(x float64) {
	if e.n == 0 {
		e.v = x
	} else {
		e.v += grayAlpha * (x - e.v)
	}
	e.n++
}

// peerSpeed is what this node observes of one peer's speed.
type peerSpeed struct {
	probe, gap ewma      // seconds
	gapAt      time.Time // the last gap observed
	strikes    int       // rounds as an outlier (while not slow) or not (while slow), less the others
	slow       bool      // this node's verdict
}

// grayState is the detector's state; guarded by mu.
type grayState struct {
	mu    sync.Mutex
	peers map[string]*peerSpeed
}

func (g *grayState) get(peer string) *peerSpeed {
	if g.peers == nil {
		g.peers = map[string]*peerSpeed{}
	}
	p := g.peers[peer]
	if p == nil {
		p = &peerSpeed{}
		g.peers[peer] = p
	}
	return p
}

// observeProbe records a successful probe's round trip.
func (r *Router) observeProbe(peer string, rtt time.Duration) {
	r.gray.mu.Lock()
	defer r.gray.mu.Unlock()
	r.gray.get(peer).probe.add(rtt.Seconds())
}

// observeGap records the time between two tokens of an answer forwarded to peer.
func (r *Router) observeGap(peer string, gap time.Duration) {
	r.gray.mu.Lock()
	defer r.gray.mu.Unlock()
	p := r.gray.get(peer)
	p.gap.add(gap.Seconds())
	p.gapAt = r.clock.Now()
}

// gapStale is how long a peer's token gaps count after the last answer forwarded to it:
// one nothing is forwarded to any more is judged by its probes alone.
const gapStale = 5 * time.Second

// judgeSpeeds compares the peers' speeds after a probe round (live lists the peers that
// count) and reports whether this node's verdict on any of them changed.
func (r *Router) judgeSpeeds(live []string) bool {
	r.gray.mu.Lock()
	defer r.gray.mu.Unlock()
	for id := range r.gray.peers {
		if !slices.Contains(live, id) {
			delete(r.gray.peers, id)
		}
	}
	var probes, gaps []float64
	now := r.clock.Now()
	for _, p := range r.gray.peers {
		if p.gap.n > 0 && now.Sub(p.gapAt) > gapStale {
			p.gap = ewma{}
		}
		if p.probe.n > 0 {
			probes = append(probes, p.probe.v)
		}
		if p.gap.n > 0 {
			gaps = append(gaps, p.gap.v)
		}
	}
	probeBase, gapBase := lowerMedian(probes), lowerMedian(gaps)
	floor := r.cfg.GrayFloor.Seconds()
	changed := false
	for id, p := range r.gray.peers {
		margin := 1.0 // the full margin to become slow; half of it to stop being slow
		if p.slow {
			margin = 0.5
		}
		// An outlier needs peers to compare with: at least two observed.
		outlier := func(e ewma, base float64, observed int) bool {
			return e.n > 0 && observed >= 2 && e.v > base*(1+margin*(r.cfg.GrayFactor-1)) && e.v > base+margin*floor
		}
		out := outlier(p.probe, probeBase, len(probes)) || outlier(p.gap, gapBase, len(gaps))
		// Strikes leak rather than reset: a starved peer's round trips come and go with
		// its throttling, and must still add up.
		switch {
		case out != p.slow:
			p.strikes++
		case p.strikes > 0:
			p.strikes--
		}
		need := r.cfg.GrayEnter
		if p.slow {
			need = r.cfg.GrayExit
		}
		if p.strikes >= need {
			p.slow, p.strikes, changed = !p.slow, 0, true
			r.log.Info("peer speed verdict changed", "peer", id, "slow", p.slow,
				"probe_ms", ms(p.probe.v), "probe_base_ms", ms(probeBase), "gap_ms", ms(p.gap.v), "gap_base_ms", ms(gapBase))
		}
	}
	return changed
}

func ms(s float64) float64 { return math.Round(s*1e4) / 10 }

// lowerMedian is the median of xs, the lower of the middle two for an even count (so of
// two peers, the faster is the reference), 0 for none.
func lowerMedian(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	xs = slices.Clone(xs)
	slices.Sort(xs)
	return xs[(len(xs)-1)/2]
}

// slowPeers lists the peers this node finds slow, to gossip.
func (r *Router) slowPeers() []string {
	r.gray.mu.Lock()
	defer r.gray.mu.Unlock()
	var out []string
	for id, p := range r.gray.peers {
		if p.slow {
			out = append(out, id)
		}
	}
	slices.Sort(out)
	return out[:min(len(out), maxSlowListed)]
}

// degradedSet is the cluster's verdict from gossip: members that more than half of the
// live members observing them (this node included) find slow. Callers hold mu.
func (r *Router) degradedSet(mine []string) map[string]bool {
	votes := map[string]int{}
	for _, id := range mine {
		votes[id]++
	}
	live := 1 // this node
	for _, m := range r.members {
		if !serving(m) {
			continue
		}
		live++
		for _, id := range m.Meta.Slow {
			if id != m.Meta.ID {
				votes[id]++
			}
		}
	}
	out := map[string]bool{}
	for id, n := range votes {
		if 2*n > live-1 { // every live member but the one judged observes it
			out[id] = true
		}
	}
	return out
}

// updateDegraded recomputes the cluster's verdict, and when it changed, says so and
// signals a ring change (conversations move). Callers hold mu.
func (r *Router) updateDegraded() {
	next := r.degradedSet(r.slowPeers())
	for id := range next {
		if !r.degraded[id] {
			r.log.Warn("member degraded: it keeps a reduced share of conversations", "member", id, "share", r.cfg.DegradedShare)
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

// aside reorders the owners of key, whose first is degraded: the degraded owner keeps the
// conversation if key falls in its share (see DegradedShare), and otherwise goes last,
// the conversation going to one of its successors chosen by key, so that its load
// spreads over them rather than doubling the first's. Every node orders them alike.
func (r *Router) aside(key string, owners []string) []string {
	h := fnv.New32a()
	h.Write([]byte(key))
	sum := h.Sum32()
	if float64(sum)/(1<<32) < r.cfg.DegradedShare {
		return owners
	}
	rest := owners[1:]
	pick := int(sum>>7) % len(rest)
	out := make([]string, 0, len(owners))
	out = append(out, rest[pick])
	out = append(out, rest[:pick]...)
	out = append(out, rest[pick+1:]...)
	return append(out, owners[0])
}

// speeds is a copy of what this node observes of its peers' speed.
func (r *Router) speeds() map[string]peerSpeed {
	r.gray.mu.Lock()
	defer r.gray.mu.Unlock()
	out := make(map[string]peerSpeed, len(r.gray.peers))
	for id, p := range r.gray.peers {
		out[id] = *p
	}
	return out
}

// Package gray finds gray failures: peers that answer their checks, so they stay healthy
// on every ring, but answer slowly (starved of CPU, throttled, behind one bad link).
// Health checks cannot see them; comparing peers can.
//
// A Detector keeps, for every peer, moving averages of what this node observes of it: the
// round trip of its probes, and the gaps between the tokens of answers forwarded to it. A
// peer whose average is an outlier against the others' (more than Factor times their
// lower median, and Floor more) for Enter judging rounds more than it is not is slow in
// this node's eyes, and stops being so after Exit such rounds back under half that margin
// (hysteresis). Token gaps are excused while the peer generates more tokens a second than
// the peers' lower median (Busy): busy, not slow. Each node gossips the peers it finds
// slow; a member is degraded when more than half of the members that observe it say so
// (Degraded), a verdict every node computes alike from gossip. A degraded node keeps
// Share of the conversations it owns (Aside); the others go to their next owner while it
// is degraded. It stays on every ring: a slow node must not become a dead one.
//
// The package is a state machine fed observations, like ring.Health: no clock (times come
// from the caller), no goroutines, no I/O, no locks (the caller serializes).
package gray

import (
	"hash/fnv"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/infernode/infernode/internal/validate"
)

// Config sets the detector's thresholds. Build one with DefaultConfig.
type Config struct {
	// Factor and Floor make a peer an outlier when its probes' round trips, or the gaps
	// between the tokens it sends back, average more than Factor times the other peers'
	// lower median and Floor more. Defaults 3 and 10ms: a LAN peer answers a probe in
	// about a millisecond, so 10ms more, three times over, is a peer in trouble (one held
	// to a quarter of a CPU waits 28ms on average).
	Factor float64
	Floor  time.Duration
	// Enter is how many judging rounds more as an outlier than not make a peer slow;
	// Exit how many under half the margin make it fast again. Defaults 4 and 6: at a
	// probe round every 500ms, 2s of it to say so.
	Enter, Exit int
	// Share is the share of the conversations it owns that a degraded member keeps; the
	// others go to their next owners until it recovers. Default 0.25.
	Share float64
	// Busy excuses a peer's long token gaps while it generates more than Busy times the
	// tokens a second of the peers' lower median (as each gossips its own): a peer at its
	// capacity with more streams than the others has longer gaps between each one's
	// tokens and generates more; a slow one, fewer or as many. 0 excuses none. Default 1
	// (more than the lower median at all). Probes are never excused.
	Busy float64
}

// DefaultConfig returns infernode's thresholds.
func DefaultConfig() Config {
	return Config{Factor: 3, Floor: 10 * time.Millisecond, Enter: 4, Exit: 6, Share: 0.25, Busy: 1}
}

// Validate reports every problem with c at once.
func (c Config) Validate() error {
	p := validate.New("")
	check := p.Check
	check(c.Factor > 1, "gray factor must be above 1, got %g", c.Factor)
	check(c.Floor >= 0, "gray floor must not be negative, got %v", c.Floor)
	check(c.Enter >= 1 && c.Exit >= 1, "gray enter and exit rounds must be at least 1, got %d and %d", c.Enter, c.Exit)
	check(c.Share >= 0 && c.Share <= 1, "degraded share must be in [0, 1], got %g", c.Share)
	check(c.Busy == 0 || c.Busy >= 1, "gray busy factor must be 0 (off) or at least 1, got %g", c.Busy)
	return p.Err()
}

// alpha weighs a new observation in a peer's moving averages: about the last 5
// observations count.
const alpha = 0.3

// MaxSlowListed bounds the peers one node gossips as slow (metadata is 512 bytes).
const MaxSlowListed = 8

// GapStale is how long a peer's token gaps count after the last one observed: a peer
// nothing is forwarded to any more is judged by its probes alone.
const GapStale = 5 * time.Second

type ewma struct {
	v float64
	n int
}

func (e *ewma) add(x float64) {
	if e.n == 0 {
		e.v = x
	} else {
		e.v += alpha * (x - e.v)
	}
	e.n++
}

// peer is what this node observes of one peer's speed.
type peer struct {
	probe, gap ewma      // seconds
	gapAt      time.Time // the last gap observed
	tps        float64   // the tokens a second it gossips it generates
	strikes    int       // rounds as an outlier (while not slow) or not (while slow), less the others
	slow       bool      // this node's verdict
}

// Detector is this node's verdict on each peer's speed.
type Detector struct {
	cfg   Config
	peers map[string]*peer
}

// NewDetector starts with no peer observed.
func NewDetector(cfg Config) *Detector { return &Detector{cfg: cfg, peers: map[string]*peer{}} }

func (d *Detector) get(id string) *peer {
	p := d.peers[id]
	if p == nil {
		p = &peer{}
		d.peers[id] = p
	}
	return p
}

// Probe records a successful probe's round trip.
func (d *Detector) Probe(id string, rtt time.Duration) { d.get(id).probe.add(rtt.Seconds()) }

// Gap records, at now, the time between two tokens of an answer forwarded to a peer.
func (d *Detector) Gap(id string, gap time.Duration, now time.Time) {
	p := d.get(id)
	p.gap.add(gap.Seconds())
	p.gapAt = now
}

// Work records the tokens a second a peer gossips it generates.
func (d *Detector) Work(id string, tps float64) { d.get(id).tps = tps }

// Change is a peer whose verdict a round changed, with what it was judged on.
type Change struct {
	Peer                                   string
	Slow                                   bool
	ProbeMS, ProbeBaseMS, GapMS, GapBaseMS float64
	TPS, TPSBase                           float64 // tokens a second: the peer's, the peers' lower median
}

// Judge compares the peers' speeds after a probe round, at now (live lists the peers that
// count; the others are forgotten), and returns the verdicts it changed.
func (d *Detector) Judge(live []string, now time.Time) []Change {
	for id := range d.peers {
		if !slices.Contains(live, id) {
			delete(d.peers, id)
		}
	}
	var probes, gaps, work []float64
	for _, p := range d.peers {
		work = append(work, p.tps)
		if p.gap.n > 0 && now.Sub(p.gapAt) > GapStale {
			p.gap = ewma{}
		}
		if p.probe.n > 0 {
			probes = append(probes, p.probe.v)
		}
		if p.gap.n > 0 {
			gaps = append(gaps, p.gap.v)
		}
	}
	probeBase, gapBase, workBase := lowerMedian(probes), lowerMedian(gaps), lowerMedian(work)
	floor := d.cfg.Floor.Seconds()
	var changes []Change
	for id, p := range d.peers {
		margin := 1.0 // the full margin to become slow; half of it to stop being slow
		if p.slow {
			margin = 0.5
		}
		// An outlier needs peers to compare with: at least two observed.
		outlier := func(e ewma, base float64, observed int) bool {
			return e.n > 0 && observed >= 2 && e.v > base*(1+margin*(d.cfg.Factor-1)) && e.v > base+margin*floor
		}
		busy := d.cfg.Busy > 0 && p.tps > d.cfg.Busy*workBase
		out := outlier(p.probe, probeBase, len(probes)) || !busy && outlier(p.gap, gapBase, len(gaps))
		// Strikes leak rather than reset: a starved peer's round trips come and go with
		// its throttling, and must still add up.
		switch {
		case out != p.slow:
			p.strikes++
		case p.strikes > 0:
			p.strikes--
		}
		need := d.cfg.Enter
		if p.slow {
			need = d.cfg.Exit
		}
		if p.strikes >= need {
			p.slow, p.strikes = !p.slow, 0
			changes = append(changes, Change{Peer: id, Slow: p.slow, ProbeMS: ms(p.probe.v), ProbeBaseMS: ms(probeBase),
				GapMS: ms(p.gap.v), GapBaseMS: ms(gapBase), TPS: p.tps, TPSBase: workBase})
		}
	}
	slices.SortFunc(changes, func(a, b Change) int { return strings.Compare(a.Peer, b.Peer) })
	return changes
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

// Slow lists the peers this node finds slow, to gossip: sorted, at most MaxSlowListed.
func (d *Detector) Slow() []string {
	var out []string
	for id, p := range d.peers {
		if p.slow {
			out = append(out, id)
		}
	}
	slices.Sort(out)
	return out[:min(len(out), MaxSlowListed)]
}

// Speed is what this node observes of a peer's speed.
type Speed struct {
	ProbeMS, GapMS float64 // moving averages
	Slow           bool    // this node's verdict
}

// Speed reports what this node observes of peer id.
func (d *Detector) Speed(id string) Speed {
	p := d.peers[id]
	if p == nil {
		return Speed{}
	}
	return Speed{ProbeMS: ms(p.probe.v), GapMS: ms(p.gap.v), Slow: p.slow}
}

// Observer is a live member and the peers it gossips as slow.
type Observer struct {
	ID   string
	Slow []string
}

// Degraded is the cluster's verdict from gossip: members that more than half of the live
// members observing them find slow, counting this node (which finds mine slow) and the
// other live members.
func Degraded(mine []string, others []Observer) map[string]bool {
	votes := map[string]int{}
	for _, id := range mine {
		votes[id]++
	}
	live := 1 + len(others) // this node and the others
	for _, o := range others {
		for _, id := range o.Slow {
			if id != o.ID {
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

// Aside reorders the owners of key, whose first is degraded: the degraded owner keeps the
// conversation if key falls in its share, and otherwise goes last, the conversation going
// to one of its successors chosen by key, so that its load spreads over them rather than
// doubling the first's. Every node orders them alike.
func Aside(key string, owners []string, share float64) []string {
	h := fnv.New32a()
	h.Write([]byte(key))
	sum := h.Sum32()
	if float64(sum)/(1<<32) < share {
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

package routing

import (
	"log/slog"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/infernode/infernode/node/gray"
)

// Gray failures (see the gray package): the view feeds its detector what it observes of
// its peers' speed, gossips its verdicts, and computes the cluster's from everyone's.

// speeds is this node's gray-failure detector, shared by the probes, the forwards that
// observe token gaps and the view.
type speeds struct {
	mu    sync.Mutex
	d     *gray.Detector
	clock Clock
	log   *slog.Logger
}

func newSpeeds(cfg gray.Config, clock Clock, log *slog.Logger) *speeds {
	return &speeds{d: gray.NewDetector(cfg), clock: clock, log: log}
}

// probe records a successful probe's round trip.
func (s *speeds) probe(peer string, rtt time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.d.Probe(peer, rtt)
}

// gap records the time between two tokens of an answer forwarded to peer.
func (s *speeds) gap(peer string, gap time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.d.Gap(peer, gap, s.clock.Now())
}

// judge compares the peers' speeds after a probe round (live lists the peers that count,
// with the tokens a second each gossips it generates) and reports whether this node's
// verdict on any of them changed.
func (s *speeds) judge(live map[string]float64) bool {
	s.mu.Lock()
	for id, tps := range live {
		s.d.Work(id, tps)
	}
	changes := s.d.Judge(slices.Collect(maps.Keys(live)), s.clock.Now())
	s.mu.Unlock()
	for _, c := range changes {
		s.log.Info("peer speed verdict changed", "peer", c.Peer, "slow", c.Slow,
			"probe_ms", c.ProbeMS, "probe_base_ms", c.ProbeBaseMS, "gap_ms", c.GapMS, "gap_base_ms", c.GapBaseMS,
			"tps", c.TPS, "tps_base", c.TPSBase)
	}
	return len(changes) > 0
}

// slow lists the peers this node finds slow, to gossip.
func (s *speeds) slow() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.d.Slow()
}

// of is what this node observes of a peer's speed.
func (s *speeds) of(peer string) gray.Speed {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.d.Speed(peer)
}

func sameKeys(a, b map[string]bool) bool {
	for k := range a {
		if !b[k] {
			return false
		}
	}
	return len(a) == len(b)
}

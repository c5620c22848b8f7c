package ring

import (
	"slices"
	"strings"
)

// Facts are what membership says about a peer.
type Facts struct {
	Alive      bool // alive (or suspect) in gossip
	Ready      bool // model loaded and warmed
	Compatible bool // same model fingerprint as this node
}

// Peer is the table's view of one peer.
type Peer struct {
	ID      string
	Facts   Facts
	Healthy bool // by this node's own checks, with hysteresis
	OnRing  bool
	// Pending: alive, ready and compatible, but never yet healthy by this node's checks
	// (first seen, its first checks to come).
	Pending bool
}

// Table is one node's view of its peers and the ring built from the eligible ones: alive,
// ready, compatible and healthy. The node itself is on the ring whenever it is ready.
// A peer first seen is unhealthy until UpAfter checks succeed, so a (re)started node
// joins rings only once it has answered.
type Table struct {
	cfg   Config
	self  string
	ready bool
	peers map[string]*entry
	ring  *Ring
}

type entry struct {
	facts  Facts
	health Health
	wasUp  bool // healthy at least once
}

// NewTable makes a table for the node self.
func NewTable(cfg Config, self string) *Table {
	t := &Table{cfg: cfg, self: self, peers: map[string]*entry{}}
	t.rebuild()
	return t
}

// SetSelfReady records whether this node can serve; it reports whether the ring changed.
func (t *Table) SetSelfReady(ready bool) bool {
	if t.ready == ready {
		return false
	}
	t.ready = ready
	return t.rebuild()
}

// SetFacts records membership facts about a peer; it reports whether the ring changed.
func (t *Table) SetFacts(id string, f Facts) bool {
	if id == t.self {
		return false
	}
	e, ok := t.peers[id]
	if !ok {
		e = &entry{health: NewHealth(false, t.cfg.DownAfter, t.cfg.UpAfter)}
		t.peers[id] = e
	}
	if ok && e.facts == f {
		return false
	}
	e.facts = f
	return t.rebuild()
}

// Forget drops a peer (it left, or was declared dead): it leaves the ring at once.
func (t *Table) Forget(id string) bool {
	if _, ok := t.peers[id]; !ok {
		return false
	}
	delete(t.peers, id)
	return t.rebuild()
}

// Observe records one check of a peer (a probe or a forward); it reports whether the
// ring changed.
func (t *Table) Observe(id string, ok bool) bool {
	e, found := t.peers[id]
	if !found || !e.health.Observe(ok) {
		return false
	}
	e.wasUp = e.wasUp || e.health.Up()
	return t.rebuild()
}

// Ring is the current ring.
func (t *Table) Ring() *Ring { return t.ring }

// Peers lists every known peer, sorted by id (the node itself not included).
func (t *Table) Peers() []Peer {
	out := make([]Peer, 0, len(t.peers))
	for id, e := range t.peers {
		f := e.facts
		out = append(out, Peer{ID: id, Facts: f, Healthy: e.health.Up(), OnRing: t.eligible(e),
			Pending: f.Alive && f.Ready && f.Compatible && !e.wasUp})
	}
	slices.SortFunc(out, func(a, b Peer) int { return strings.Compare(a.ID, b.ID) })
	return out
}

func (t *Table) eligible(e *entry) bool {
	return e.facts.Alive && e.facts.Ready && e.facts.Compatible && e.health.Up()
}

// rebuild makes a new ring if the eligible set changed, and reports whether it did.
func (t *Table) rebuild() bool {
	var ids []string
	if t.ready {
		ids = append(ids, t.self)
	}
	for id, e := range t.peers {
		if t.eligible(e) {
			ids = append(ids, id)
		}
	}
	slices.Sort(ids)
	if t.ring != nil && slices.Equal(ids, t.ring.members) {
		return false
	}
	t.ring = New(t.cfg, ids)
	return true
}

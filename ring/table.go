package ring

import (
	"slices"
	"strings"
	"sync"
	"sync/atomic"
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
//
// Changes are recorded by SetSelfReady, SetFacts, Forget and Observe and take effect in
// one ring update at the next Commit, so a burst (a join storm, a round of probes) costs
// one update. A Table is safe for concurrent use, and Ring never waits: a Commit builds
// the next ring while readers keep using the last one.
type Table struct {
	cfg   Config
	self  string
	build sync.Mutex // serializes Commits
	mu    sync.Mutex // guards ready and peers
	ready bool
	peers map[string]*entry
	ring  atomic.Pointer[Ring]
}

type entry struct {
	facts  Facts
	health Health
	wasUp  bool // healthy at least once
}

// NewTable makes a table for the node self.
func NewTable(cfg Config, self string) *Table {
	t := &Table{cfg: cfg, self: self, peers: map[string]*entry{}}
	t.ring.Store(New(cfg, nil))
	return t
}

// SetSelfReady records whether this node can serve, and reports whether that changed.
func (t *Table) SetSelfReady(ready bool) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	changed := t.ready != ready
	t.ready = ready
	return changed
}

// SetFacts records membership facts about a peer.
func (t *Table) SetFacts(id string, f Facts) {
	if id == t.self {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	e, ok := t.peers[id]
	if !ok {
		e = &entry{health: NewHealth(false, t.cfg.DownAfter, t.cfg.UpAfter)}
		t.peers[id] = e
	}
	e.facts = f
}

// Forget drops a peer (it left, or was declared dead): it leaves the ring at the next
// Commit.
func (t *Table) Forget(id string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.peers, id)
}

// Observe records one check of a peer (a probe or a forward) and reports whether its
// health flipped.
func (t *Table) Observe(id string, ok bool) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	e, found := t.peers[id]
	if !found || !e.health.Observe(ok) {
		return false
	}
	e.wasUp = e.wasUp || e.health.Up()
	return true
}

// Commit makes the ring of the peers eligible now, if they differ from the current
// ring's, and reports whether it did.
func (t *Table) Commit() bool {
	t.build.Lock()
	defer t.build.Unlock()
	cur := t.ring.Load()
	var add, remove []string
	t.mu.Lock()
	eligible := func(id string) bool {
		if id == t.self {
			return t.ready
		}
		e, ok := t.peers[id]
		return ok && t.eligible(e)
	}
	for _, id := range cur.members {
		if !eligible(id) {
			remove = append(remove, id)
		}
	}
	if t.ready && !cur.Has(t.self) {
		add = append(add, t.self)
	}
	for id, e := range t.peers {
		if t.eligible(e) && !cur.Has(id) {
			add = append(add, id)
		}
	}
	t.mu.Unlock()
	if len(add) == 0 && len(remove) == 0 {
		return false
	}
	t.ring.Store(cur.Apply(add, remove))
	return true
}

// Ring is the ring as of the last Commit. It never blocks.
func (t *Table) Ring() *Ring { return t.ring.Load() }

// Peers lists every known peer, sorted by id (the node itself not included). OnRing is
// as of the last Commit.
func (t *Table) Peers() []Peer {
	rg := t.Ring()
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]Peer, 0, len(t.peers))
	for id, e := range t.peers {
		f := e.facts
		out = append(out, Peer{ID: id, Facts: f, Healthy: e.health.Up(), OnRing: rg.Has(id),
			Pending: f.Alive && f.Ready && f.Compatible && !e.wasUp})
	}
	slices.SortFunc(out, func(a, b Peer) int { return strings.Compare(a.ID, b.ID) })
	return out
}

func (t *Table) eligible(e *entry) bool {
	return e.facts.Alive && e.facts.Ready && e.facts.Compatible && e.health.Up()
}

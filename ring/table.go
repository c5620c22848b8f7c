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
	Compatible bool // speaks this node's protocol: may be on its rings
	// Model names the ring of the model the peer serves, when that is not this node's
	// model (a fingerprint, say); empty: this node's model, whose ring this node is on.
	Model string
}

// Peer is the table's view of one peer.
type Peer struct {
	ID      string
	Facts   Facts
	Healthy bool // by this node's own checks, with hysteresis (on a ring or not: Table.OnRing)
	// Pending: alive, ready and compatible, serving this node's model, but never yet
	// healthy by this node's checks (first seen, its first checks to come).
	Pending bool
}

// Table is one node's view of its peers and the rings built from the eligible ones: alive,
// ready, compatible and healthy, one ring for each model served (see Facts.Model). The
// node itself is on its own model's ring whenever it is ready.
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
	rings atomic.Pointer[map[string]*Ring] // by model, "" this node's; replaced whole
}

type entry struct {
	facts  Facts
	health Health
	wasUp  bool // healthy at least once
}

// NewTable makes a table for the node self.
func NewTable(cfg Config, self string) *Table {
	t := &Table{cfg: cfg, self: self, peers: map[string]*entry{}}
	t.rings.Store(&map[string]*Ring{"": New(cfg, nil)})
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

// Commit makes the rings of the peers eligible now, if they differ from the current
// rings, and reports whether this node's own ring changed.
func (t *Table) Commit() bool {
	t.build.Lock()
	defer t.build.Unlock()
	cur := *t.rings.Load()
	want := map[string]map[string]bool{"": {}}
	t.mu.Lock()
	if t.ready {
		want[""][t.self] = true
	}
	for id, e := range t.peers {
		if t.eligible(e) {
			if want[e.facts.Model] == nil {
				want[e.facts.Model] = map[string]bool{}
			}
			want[e.facts.Model][id] = true
		}
	}
	t.mu.Unlock()
	next := make(map[string]*Ring, len(want))
	changed := map[string]bool{}
	for model, ids := range want {
		rg := cur[model]
		if rg == nil {
			rg = New(t.cfg, nil)
		}
		var add, remove []string
		for _, id := range rg.members {
			if !ids[id] {
				remove = append(remove, id)
			}
		}
		for id := range ids {
			if !rg.Has(id) {
				add = append(add, id)
			}
		}
		if len(add) > 0 || len(remove) > 0 {
			rg, changed[model] = rg.Apply(add, remove), true
		}
		next[model] = rg
	}
	if len(changed) == 0 && len(next) == len(cur) {
		return false
	}
	t.rings.Store(&next)
	return changed[""]
}

// Ring is this node's model's ring as of the last Commit. It never blocks.
func (t *Table) Ring() *Ring { return (*t.rings.Load())[""] }

// RingOf is model's ring as of the last Commit (see Facts.Model), nil when no peer
// serving it is eligible.
func (t *Table) RingOf(model string) *Ring { return (*t.rings.Load())[model] }

// OnRing reports whether id is on any ring, as of the last Commit.
func (t *Table) OnRing(id string) bool {
	for _, rg := range *t.rings.Load() {
		if rg.Has(id) {
			return true
		}
	}
	return false
}

// Models lists the models of the rings other than this node's that have members.
func (t *Table) Models() []string {
	var out []string
	for model := range *t.rings.Load() {
		if model != "" {
			out = append(out, model)
		}
	}
	slices.Sort(out)
	return out
}

// Healthy reports whether peer id is up by this node's checks (whether or not it is on a
// ring: a peer that owns nothing is checked all the same).
func (t *Table) Healthy(id string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	e, ok := t.peers[id]
	return ok && e.health.Up()
}

// Peers lists every known peer, sorted by id (the node itself not included).
func (t *Table) Peers() []Peer {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]Peer, 0, len(t.peers))
	for id, e := range t.peers {
		f := e.facts
		out = append(out, Peer{ID: id, Facts: f, Healthy: e.health.Up(),
			Pending: f.Alive && f.Ready && f.Compatible && f.Model == "" && !e.wasUp})
	}
	slices.SortFunc(out, func(a, b Peer) int { return strings.Compare(a.ID, b.ID) })
	return out
}

func (t *Table) eligible(e *entry) bool {
	return e.facts.Alive && e.facts.Ready && e.facts.Compatible && e.health.Up()
}

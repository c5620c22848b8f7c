package routing

import (
	"math"
	"slices"
	"sync"
	"time"

	"github.com/infernode/infernode/node/hop"
	"github.com/infernode/infernode/session/infer"
)

// Placement by load. Hashing puts a few long conversations on one node as readily as on
// another: measured on two nodes of one core each, the ring gave one of them 32 of 42
// conversations' requests, and it ran saturated while the other idled (docs/BENCHMARKS.md).
// A conversation that is nowhere yet costs a prefill wherever it goes, so its owner, when
// it is the busier by Config.PlaceMargin requests and holds none of its KV, places it on
// the least loaded other candidate instead: it declines the request (503,
// hop.CodeDeclined) naming that node, and remembers it. The conversation's KV is then that
// node's own, and its later turns, which reach the owner as the ring says, are declined to
// it too: decode stays where the KV is. That node keeps its replicas on the owner as on any
// heir, so when it dies the owner serves the conversation warm, and a ring change
// elsewhere leaves the conversation where it is (kvmove.Mover.Away). Nothing is refused
// for placement: an owner whose choice is refused, or who has no other candidate, serves
// the request after all (placeNext).

// placeTTL is how long an owner remembers where it placed a conversation; maxPlaced bounds
// the memory (past it, the oldest half is forgotten: a forgotten conversation's next
// turn is served by its owner, from the replica it keeps, or cold).
const (
	placeTTL  = 30 * time.Minute
	maxPlaced = 1 << 16
)

// placed is where this node, as owner, placed conversations.
type placed struct {
	mu sync.Mutex
	at map[string]placedAt
}

type placedAt struct {
	node string
	when time.Time
}

func (p *placed) get(key string, now time.Time) string {
	p.mu.Lock()
	defer p.mu.Unlock()
	if a, ok := p.at[key]; ok && now.Sub(a.when) < placeTTL {
		return a.node
	}
	return ""
}

func (p *placed) put(key, node string, now time.Time) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.at == nil {
		p.at = map[string]placedAt{}
	}
	if len(p.at) >= maxPlaced {
		whens := make([]time.Time, 0, len(p.at))
		for _, a := range p.at {
			whens = append(whens, a.when)
		}
		slices.SortFunc(whens, time.Time.Compare)
		median := whens[len(whens)/2]
		for k, a := range p.at {
			if !a.when.After(median) {
				delete(p.at, k)
			}
		}
	}
	p.at[key] = placedAt{node, now}
}

func (p *placed) forget(key string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.at, key)
}

// placement is what an entry node lets req's first candidate, its owner, do: decline it
// when the owner runs and queues more than the returned load (0: it may not), the least
// loaded other candidate's that could serve req plus Config.PlaceMargin. With only slow
// candidates besides, no load is enough, but the owner may still send a conversation it
// placed before to where its KV is. Only a request's first leg is placed, never a resumed
// one or a prefill.
func (r *Router) placement(cands []candidate, req infer.Request) int {
	if r.cfg.PlaceMargin == 0 || req.SessionID == "" || req.PrefillOnly || len(req.Continue) > 0 || len(cands) < 2 {
		return 0
	}
	above := 0
	for _, c := range cands[1:] { // in order of preference: not full, not slow, least loaded first
		switch {
		case c.full || c.minor < hop.MinorFor(req):
		case !c.slow:
			return c.load + r.cfg.PlaceMargin
		default:
			above = math.MaxInt32
		}
	}
	return above
}

// Place decides, on req's conversation's owner, whether it declines req, which lets it
// decline above load (hop.Request.DeclineAbove), and names the node to serve it instead:
// the node it placed the conversation on before, while that is a candidate still; else,
// when this node holds none of the conversation's KV (not even a replica: a turn served
// from one is warm) and runs and queues more than above, the least loaded other
// candidate, remembered for the conversation's next turns. A conversation this node owns
// the KV of is served here.
func (r *Router) Place(req infer.Request, above int) (to string, decline bool) {
	key := req.SessionID
	if above <= 0 {
		return "", false
	}
	if r.local.Owns(key) {
		r.placed.forget(key)
		return "", false
	}
	now := r.clock.Now()
	to = r.placed.get(key, now)
	loaded := func() bool {
		st := r.local.Stats()
		return st.Running+st.Waiting > above && !r.local.Holds(key)
	}
	if to == "" && !loaded() {
		return "", false
	}
	cands := r.v.candidates("", key)
	eligible := func(c candidate) bool {
		return c.id != r.cfg.Self && !c.full && c.minor >= hop.MinorFor(req)
	}
	if to != "" {
		if slices.ContainsFunc(cands, func(c candidate) bool { return c.id == to && eligible(c) }) {
			return to, true
		}
		r.placed.forget(key)
		if !loaded() {
			return "", false
		}
	}
	i := slices.IndexFunc(cands, func(c candidate) bool { return eligible(c) && !c.slow })
	if i < 0 {
		return "", false
	}
	r.placed.put(key, cands[i].id, now)
	return cands[i].id, true
}

// place is Place for the i-th candidate of a request this node entered, itself: only
// the first, its owner, may decline it.
func (r *Router) place(i int, req infer.Request, above int) (string, bool) {
	if i != 0 {
		return "", false
	}
	return r.Place(req, above)
}

// placeNext puts next after cands[i] the candidate named to, when it is among those after
// i, then c, the owner that declined (after i it may not decline again): a declined
// request goes where its owner placed it, else back to its owner, before any other.
func placeNext(cands []candidate, i int, to string, c candidate) []candidate {
	rest := slices.Clone(cands[i+1:])
	out := append(cands[:i+1:i+1], c)
	if j := slices.IndexFunc(rest, func(x candidate) bool { return x.id == to }); j >= 0 {
		out = slices.Insert(out, i+1, rest[j])
		rest = slices.Delete(rest, j, j+1)
	}
	return append(out, rest...)
}

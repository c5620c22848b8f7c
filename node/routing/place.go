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
//
// With replicas on, a conversation is warm on more than one node: where its last turn ran,
// and on the nodes that took that turn's replica. Its owner then moves its next turn to
// whichever of those runs the margin fewer requests: it declines a conversation it owns to
// a less loaded node that took its last replica, and takes back one it placed when it
// holds that node's replica and that node is the busier by the margin. A conversation's
// turns thus follow the load as well as its KV, and none of them is cold for it; a node
// that took a replica and evicted it since serves the turn cold, as the owner would have
// served a conversation it did not hold.

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
// decline above load (hop.Request.DeclineAbove), and names the node to serve it instead,
// remembered for the conversation's next turns. This node runs and queues more than above
// in each case but the second:
//   - it owns the conversation's KV, and a node that took its last replica runs the
//     margin fewer requests: that node;
//   - it placed the conversation on a node before, which is a candidate still: that
//     node, unless this node holds a replica of the conversation and that node runs the
//     margin more requests (then it is served here, and forgotten);
//   - it holds none of the conversation's KV (a turn served from a replica is warm): the
//     least loaded other candidate.
//
// Otherwise the request is served here.
func (r *Router) Place(req infer.Request, above int) (to string, decline bool) {
	key := req.SessionID
	if above <= 0 {
		return "", false
	}
	st := r.local.Stats()
	here := st.Running + st.Waiting
	cands := r.v.candidates("", key)
	eligible := func(c candidate) bool {
		return c.id != r.cfg.Self && !c.full && c.minor >= hop.MinorFor(req)
	}
	now := r.clock.Now()
	if r.local.Owns(key) {
		r.placed.forget(key)
		if here <= above {
			return "", false
		}
		replicas := r.kv.Replicas(key)
		i := slices.IndexFunc(cands, func(c candidate) bool {
			return eligible(c) && !c.slow && slices.Contains(replicas, c.id) && here > c.load+r.cfg.PlaceMargin
		})
		if i < 0 {
			return "", false
		}
		r.placed.put(key, cands[i].id, now)
		return cands[i].id, true
	}
	if to = r.placed.get(key, now); to != "" {
		i := slices.IndexFunc(cands, func(c candidate) bool { return c.id == to && eligible(c) })
		switch {
		case i >= 0 && r.local.Holds(key) && cands[i].load > here+r.cfg.PlaceMargin:
			r.placed.forget(key)
			return "", false
		case i >= 0:
			return to, true
		}
		r.placed.forget(key)
	}
	if here <= above || r.local.Holds(key) {
		return "", false
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

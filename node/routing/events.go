package routing

import (
	"sync"
	"time"
)

// Happening is something that happened in the cluster, as this node saw it: for operators
// (the dashboard's feed), not for routing decisions.
type Happening struct {
	Seq  uint64    `json:"seq"`
	Time time.Time `json:"time"`
	// Kind is one of: join (a peer appeared in gossip), leave (it left gracefully), dead
	// (gossip declared it dead), down and up (this node's checks took it off its ring or
	// put it back), ring (this node's ring changed), resume (an answer moved to another
	// owner mid-stream), handoff (a conversation's KV went to a peer: its new owner or,
	// as a replica, its heir).
	Kind   string `json:"kind"`
	Peer   string `json:"peer,omitempty"`
	Detail string `json:"detail,omitempty"`
}

// happenings keeps the last few Happenings and hands new ones to subscribers. A
// subscriber that falls behind loses what it could not take, never blocking routing.
type happenings struct {
	now  func() time.Time
	mu   sync.Mutex
	seq  uint64
	last []Happening // the most recent, oldest first, at most keepHappenings
	subs map[chan Happening]struct{}
}

const keepHappenings = 200

func (h *happenings) add(kind, peer, detail string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.seq++
	e := Happening{Seq: h.seq, Time: h.now(), Kind: kind, Peer: peer, Detail: detail}
	if len(h.last) == keepHappenings {
		h.last = append(h.last[:0], h.last[1:]...)
	}
	h.last = append(h.last, e)
	for ch := range h.subs {
		select {
		case ch <- e:
		default:
		}
	}
}

// Happened records an event of this node's own (kind "anomaly": a latency alert).
func (r *Router) Happened(kind, detail string) { r.v.events.add(kind, r.cfg.Self, detail) }

// Happenings returns what happened lately, oldest first, and subscribes to what happens
// next until stop is called.
func (r *Router) Happenings() (recent []Happening, next <-chan Happening, stop func()) {
	h := r.v.events
	ch := make(chan Happening, 64)
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.subs == nil {
		h.subs = map[chan Happening]struct{}{}
	}
	h.subs[ch] = struct{}{}
	stop = func() {
		h.mu.Lock()
		defer h.mu.Unlock()
		delete(h.subs, ch)
	}
	return append([]Happening(nil), h.last...), ch, stop
}

// decodeRate is the tokens a second a node generated over the last rateEvery or more.
type decodeRate struct {
	mu    sync.Mutex
	at    time.Time
	count uint64
	rate  float64
}

const rateEvery = 2 * time.Second

// current is the rate as of the last update.
func (d *decodeRate) current() float64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.rate
}

// update takes the engine's count of generated tokens at now and returns the rate.
func (d *decodeRate) update(now time.Time, generated uint64) float64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	switch {
	case d.at.IsZero() || generated < d.count:
		d.at, d.count = now, generated
	case now.Sub(d.at) >= rateEvery:
		d.rate = float64(generated-d.count) / now.Sub(d.at).Seconds()
		d.at, d.count = now, generated
	}
	return d.rate
}

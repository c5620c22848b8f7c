package routing

import (
	"context"
	"time"

	"github.com/infernode/infernode/node/hop"
	"github.com/infernode/infernode/node/kvmove"
	"github.com/infernode/infernode/node/quota"
	"github.com/infernode/infernode/node/stored"
	"github.com/infernode/infernode/ring"
	"github.com/infernode/infernode/session/infer"
)

// KV returns the mover of this node's conversations' KV caches (see kvmove).
func (r *Router) KV() *kvmove.Mover { return r.kv }

// Served is told that a turn of key's conversation was served here and is complete: its
// KV is kept warm where the next turn would go if this node were gone (see
// kvmove.Mover.KeepWarm).
func (r *Router) Served(key string, draining bool) { r.kv.KeepWarm(key, draining) }

// Leave hands this leaving node's caches off (see node.Cluster): the KV of what is idle as
// the drain begins, so that a next turn rarely reaches the heir first (it pulls from here
// if it does: this node answers until it has left); the stored responses and the rest
// once the drain is over.
func (r *Router) Leave(ctx context.Context, drained bool) {
	if drained {
		r.stored.HandOff(ctx, true) // small records first
	}
	r.kv.HandOff(ctx, true)
}

// TakeKV installs a conversation's KV frame a peer pushed (see kvmove.Mover.Take).
func (r *Router) TakeKV(ctx context.Context, frame []byte, origin infer.Origin, from string) (infer.Imported, error) {
	return r.kv.Take(ctx, frame, origin, from)
}

// GiveKV answers a peer's pull whose hop had nonce and minor version minor, signing the
// answer with sign (see kvmove.Mover.Give).
func (r *Router) GiveKV(ctx context.Context, key, peer, nonce string, minor int, sign func(name, value string)) (infer.Frame, error) {
	return r.kv.Give(ctx, key, peer, nonce, minor, sign)
}

// Stored keeps this node's stored responses (see stored.Keeper).
func (r *Router) Stored() *stored.Keeper { return r.stored }

// Quota holds tenants to their rate limits (see quota.Quota).
func (r *Router) Quota() *quota.Quota { return r.quota }

// quotaRing is the router's view as quota sees it: a bucket lives on the owner of its key
// on the model's ring.
type quotaRing struct{ r *Router }

func (k quotaRing) Size(model string) int {
	if t, ok := k.r.v.target(model); ok {
		return k.r.v.table.RingOf(t.ring).Len()
	}
	return 1
}

func (k quotaRing) Owner(model, key string) (quota.Peer, bool) {
	t, ok := k.r.v.target(model)
	if !ok {
		return quota.Peer{}, true
	}
	rg := k.r.v.table.RingOf(t.ring)
	if rg == nil {
		return quota.Peer{}, true
	}
	id, ok := rg.Owner(key)
	if !ok || id == k.r.cfg.Self {
		return quota.Peer{}, true
	}
	k.r.v.mu.Lock()
	defer k.r.v.mu.Unlock()
	m := k.r.v.members[id].Meta
	return quota.Peer{ID: id, Addr: m.HTTPAddr, Minor: m.HopMinor}, false
}

// ServeLocal serves req on this node's engine: from the response cache when it holds the
// answer (see node/answers); else first pulling its conversation's KV from where it was
// served before when this node does not hold it (see kvmove.Mover.BeforeServe), pulling
// its prompt's beginning from a peer that holds it (see prefix.go), or having a prefill
// node prefill it (see prefill.go).
func (r *Router) ServeLocal(ctx context.Context, req infer.Request) (infer.Stream, error) {
	return r.answers.Serve(req, func() (infer.Stream, error) {
		if r.cfg.PlaceMargin > 0 && req.SessionID != "" {
			// Served here, not on its owner: placed here (or spilled), so a ring change
			// elsewhere leaves it here (kvmove.Mover.Away).
			if owner, other := (kvRing{r}).Owner(req.SessionID); other {
				r.kv.Away(req.SessionID, owner.ID)
			}
		}
		r.kv.BeforeServe(ctx, req)
		req = r.prefixElsewhere(ctx, req)
		r.prefillElsewhere(ctx, req)
		return r.local.Submit(ctx, req)
	})
}

// followRing hands what this node no longer owns to the new owners whenever its ring
// changes (a join, a return), once the ring has been quiet for the KV settle time (a
// join comes with a short burst of changes): the conversations' stored responses, then
// their KV. It returns when ctx ends.
func (r *Router) followRing(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-r.v.ringCh:
		}
		for quiet := false; !quiet; {
			select {
			case <-ctx.Done():
				return
			case <-r.v.ringCh:
			case <-time.After(r.cfg.KV.Settle):
				quiet = true
			}
		}
		r.stored.HandOff(ctx, false)
		r.kv.HandOff(ctx, false)
	}
}

// kvRing is the router's view as kvmove sees it.
type kvRing struct{ r *Router }

func (k kvRing) Owner(key string) (kvmove.Peer, bool) {
	c := k.r.v.candidates("", key)
	if len(c) == 0 || c[0].id == k.r.cfg.Self {
		return kvmove.Peer{}, false
	}
	return kvmove.Peer{ID: c[0].id, Addr: c[0].addr, Minor: c[0].minor}, true
}

func (k kvRing) Heirs(key string, n int) []kvmove.Peer {
	var out []kvmove.Peer
	for _, c := range k.r.v.heirs(key, n) {
		out = append(out, kvmove.Peer{ID: c.id, Addr: c.addr, Minor: c.minor})
	}
	return out
}

func (k kvRing) Prefill(peer string) float64 {
	k.r.v.mu.Lock()
	defer k.r.v.mu.Unlock()
	return float64(k.r.v.members[peer].Meta.Prefill)
}

func (k kvRing) Joined() time.Time {
	k.r.v.mu.Lock()
	defer k.r.v.mu.Unlock()
	return k.r.v.joined
}

func (k kvRing) Leavers() []kvmove.Peer {
	var out []kvmove.Peer
	for _, c := range k.r.v.leavers() {
		out = append(out, kvmove.Peer{ID: c.id, Addr: c.addr, Minor: c.minor})
	}
	return out
}

func (k kvRing) Happened(kind, peer, detail string) { k.r.v.events.add(kind, peer, detail) }

// storedRing is the router's view as stored sees it: a conversation's records live on
// its owner and the owner's heirs, like its KV and replicas.
type storedRing struct{ r *Router }

func (k storedRing) Self() string { return k.r.cfg.Self }

func (k storedRing) Owners(key string, n int) []stored.Peer {
	owner, ok := k.r.v.table.Ring().Owner(key)
	if !ok || n < 1 {
		return nil
	}
	out := []stored.Peer{k.peer(owner)}
	for _, c := range k.r.v.heirs(key, n-1, owner) {
		out = append(out, stored.Peer{ID: c.id, Addr: c.addr, Minor: c.minor})
	}
	return out
}

func (k storedRing) Heirs(key string, n int) []stored.Peer {
	var out []stored.Peer
	for _, c := range k.r.v.heirs(key, n) {
		out = append(out, stored.Peer{ID: c.id, Addr: c.addr, Minor: c.minor})
	}
	return out
}

func (k storedRing) peer(id string) stored.Peer {
	if id == k.r.cfg.Self {
		return stored.Peer{ID: id, Minor: hop.Minor}
	}
	k.r.v.mu.Lock()
	defer k.r.v.mu.Unlock()
	m := k.r.v.members[id].Meta
	return stored.Peer{ID: id, Addr: m.HTTPAddr, Minor: m.HopMinor}
}

type heirKey struct {
	base *ring.Ring
	gone string
}

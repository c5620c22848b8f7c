package routing

import (
	"context"
	"errors"
	"io"
	"slices"
	"time"

	"github.com/infernode/infernode/node/kvmove"
	"github.com/infernode/infernode/session/infer"
)

// Prefill elsewhere (disaggregated prefill). A long prompt's prefill stalls every stream
// decoding on the same node. A node of role RoleDecode (or RoleBoth) that must prefill a
// conversation's prompt it holds nothing of may have a prefill node (RolePrefill, which
// owns no conversation) do it: it sends the peer the prompt as a prefill-only request
// under the conversation's key, pulls the KV the peer computed (the signed pull of
// kvmove), and serves the turn from it, so its own engine only decodes. It falls back to
// prefilling itself when no prefill node is ready and free, when the peer or the pull
// fails (a prefill node that dies mid-prefill costs only this local prefill), or when
// the measured costs say a local prefill is sooner:
//
//   - what the pull costs: the frame (the prompt's tokens at the KV bytes a token the
//     mover has seen) at the rate measured to the peer, plus two round trips;
//   - what a local prefill costs: the tokens at the rate this node prefills at its
//     recent load (its decode streams slow it);
//   - for a RoleBoth node, the peer's prefill at the rate it gossips too: it sends work
//     away only when that answers sooner. A RoleDecode node does not count it: keeping
//     prefill off its decode streams is its role, and it waits for the pull only.
//
// The prompt's tokens are estimated from its bytes (promptBytesPerToken) before any
// tokenizing: both costs grow with the tokens, so the estimate matters only against the
// round trips.

// Roles a node may have (Config.Role), gossiped in Meta.Role.
const (
	RoleBoth    = "both"
	RoleDecode  = "decode"
	RolePrefill = "prefill"
)

// promptBytesPerToken estimates a prompt's tokens from its bytes (English text with a
// BPE vocabulary of tens of thousands: 4 bytes a token).
const promptBytesPerToken = 4

// prefillElsewhere has a prefill node prefill req's prompt and installs the KV it
// computed here, when this node's role and the measured costs say so (see above).
// Whatever happens, the turn is served here after it.
func (r *Router) prefillElsewhere(ctx context.Context, req infer.Request) {
	if r.cfg.Role == RolePrefill || req.SessionID == "" || req.PrefillOnly || req.PromptLogprobs || len(req.Continue) > 0 ||
		len(req.Messages) > 0 || r.local.Holds(req.SessionID) {
		return
	}
	peers := r.v.prefillers()
	if len(peers) == 0 {
		return
	}
	p := peers[0]
	tokens := len(req.Tokens)
	if tokens == 0 {
		tokens = len(req.Prompt) / promptBytesPerToken
	}
	// A node of role both counts the peer's prefill too, and prefills itself until it
	// knows its own rate; a decode node keeps prefill off its decoding streams, and sends
	// it away even before it knows the costs (the first pulls measure them).
	peerPrefills := 0
	if r.cfg.Role == RoleBoth {
		peerPrefills = tokens
	}
	if beats, known := r.pullBeatsPrefill(p, tokens, peerPrefills, tokens); !beats || !known && r.cfg.Role != RoleDecode {
		r.prefills.WithLabelValues("recompute").Inc()
		return
	}
	start := r.clock.Now()
	err := r.prefillAndPull(ctx, p, prefillOnly(req), infer.Prefilled, tokens)
	if err != nil {
		r.prefills.WithLabelValues("failed").Inc()
		r.log.Warn("prefill elsewhere failed; prefilling here", "peer", p.id, "session", req.SessionID, "err", err)
		return
	}
	r.prefills.WithLabelValues("ok").Inc()
	r.log.Debug("prefilled elsewhere", "peer", p.id, "session", req.SessionID, "tokens", tokens, "took", r.clock.Now().Sub(start))
}

// prefillAndPull has peer p run pre, a prefill-only request (see prefillOnly), waits for
// its end, and pulls the KV p computed for pre's conversation, installing it as having
// come as origin; the pull saves this node prefilling saved tokens (and may take as long).
func (r *Router) prefillAndPull(ctx context.Context, p candidate, pre infer.Request, origin infer.Origin, saved int) error {
	st, err := r.forward(ctx, p, r.cfg.Model, pre, 0)
	if err != nil {
		return err
	}
	for {
		if _, err := st.Recv(); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			return err
		}
	}
	saves := r.prefillTime(saved)
	if saves == 0 && p.prefill > 0 { // this node has prefilled nothing yet: the peer's rate, same model
		saves = time.Duration(float64(saved) / p.prefill * float64(time.Second))
	}
	n, err := r.kv.Fetch(ctx, kvmove.Peer{ID: p.id, Addr: p.addr, Minor: p.minor}, pre.SessionID, origin, saves)
	if err == nil && n == 0 {
		err = errors.New("the peer sent no KV (evicted, or cheaper to recompute)")
	}
	return err
}

// prefillOnly is req as a prefill-only request for a peer: its prompt's KV computed,
// nothing generated, cached or sampled.
func prefillOnly(req infer.Request) infer.Request {
	pre := req
	pre.PrefillOnly, pre.MaxTokens, pre.CacheAnswer, pre.Logprobs, pre.TopLogprobs, pre.Batch = true, 0, false, false, 0, false
	pre.Schema, pre.Answered, pre.FollowUp = "", "", false
	return pre
}

// pullBeatsPrefill compares pulling the KV of moved tokens from peer p, after p has
// prefilled peerPrefills of them at the rate it gossips, with this node's own prefill of
// the saved tokens it would otherwise prefill, at its recent rate. Costs it cannot
// estimate yet count as nothing; known is false when this node's own rate is not known
// yet.
func (r *Router) pullBeatsPrefill(p candidate, moved, peerPrefills, saved int) (beats, known bool) {
	rtt := time.Duration(r.v.speed.of(p.id).ProbeMS * float64(time.Millisecond))
	remote := 2*rtt + r.kv.TransferTime(p.id, moved)
	if peerPrefills > 0 && p.prefill > 0 {
		remote += time.Duration(float64(peerPrefills) / p.prefill * float64(time.Second))
	}
	local := r.prefillTime(saved)
	if local == 0 {
		return true, false
	}
	return remote < local, true
}

// prefillTime is how long this node would take to prefill tokens at its recent rate (0
// while it has none).
func (r *Router) prefillTime(tokens int) time.Duration {
	rate := r.local.Stats().PrefillRate
	if rate <= 0 {
		return 0
	}
	return time.Duration(float64(tokens) / rate * float64(time.Second))
}

// prefillers are the prefill nodes that could take a prompt now: of this node's model,
// ready, healthy by this node's checks, not degraded, with nothing waiting; least loaded
// first.
func (v *view) prefillers() []candidate {
	v.mu.Lock()
	defer v.mu.Unlock()
	var out []candidate
	for id, m := range v.members {
		if m.Meta.Role != RolePrefill || !v.up(id) || !m.Meta.Ready || v.ringOf(m.Meta) != "" ||
			v.degraded[id] || m.Meta.Waiting > 0 || m.Meta.HopMinor < 7 {
			continue
		}
		out = append(out, candidate{id: id, addr: m.Meta.HTTPAddr, load: m.Meta.Running, minor: m.Meta.HopMinor, prefill: float64(m.Meta.Prefill)})
	}
	slices.SortFunc(out, func(a, b candidate) int { return a.load - b.load })
	return out
}

package routing

import (
	"context"
	"math/bits"
	"time"

	"github.com/infernode/infernode/session/infer"
)

// One prefix, one prefill per cluster. Within a node, a conversation whose prompt begins
// as another's (a system prompt, a document asked about) shares its cells (session's
// sharedPrefix). Across nodes, conversations that begin alike hash to different owners,
// and each owner would prefill the beginning again. So every node gossips a digest of the
// beginnings it holds (a gossip note, see gossip's notes.go: memberlist's 512 bytes of
// node metadata could not hold it), and the owner of a new conversation whose beginning a
// peer's digest shows, for longer than this node holds it, has that peer prefill the
// prompt up to one block past what the digest shows, as a prefill-only request under the
// conversation's key (the peer reuses the cells it holds, to the token, and prefills the
// rest, which this node would have prefilled anyway), pulls the KV (the signed pull of
// kvmove: the peer keeps its copy as a replica, evicted first) and prefills only what
// follows. It does so when the pull's measured cost (the frame at the rate measured to
// the peer, two round trips) is below prefilling those tokens here; any failure costs
// the local prefill it replaces.
//
// The digest is a Bloom filter of the chained hashes of the beginnings' 32-token blocks
// (session's Prefixes: each covers the model, the sharing domain and every token before
// it), the most recently used conversations' first: digestBits bits, digestProbes probes
// a hash, digestBlocks hashes at most (about 2% false positives when full: 12,800 tokens
// of distinct beginnings). A beginning counts as held only when every one of its blocks
// is in the filter from the first, so a false match of k blocks is about 0.02^k likely.
// A digest that is stale (the cells evicted since) or wrong costs the peer a prefill and
// this node a pull, never a wrong answer: the peer is sent the tokens themselves, and a
// conversation's domain (its tenant and salt) is in every hash, so only conversations of
// one domain ever share.

const (
	digestFormat = 1    // the note's first byte: its layout
	digestBits   = 4096 // 512 bytes: a gossip note (gossip.MaxNote)
	digestProbes = 3
	digestBlocks = 400
	// minPulledBlocks is the shortest beginning worth asking a peer for.
	minPulledBlocks = 2
	// digestEvery is how often this node's digest is computed again (gossip sends it as
	// its NoteUpdates allow).
	digestEvery = time.Second
)

// digest is a Bloom filter of prefix hashes, as gossiped: the format byte, then the bits.
type digest []byte

func newDigest(hashes []uint64) digest {
	d := make(digest, 1+digestBits/8)
	d[0] = digestFormat
	for _, h := range hashes {
		for i := range digestProbes {
			byt, mask := probe(h, i)
			d[byt] |= mask
		}
	}
	return d
}

// probe is where a hash's i-th probe falls in a digest: a byte and a bit in it (the
// hash's i-th 16 bits, modulo the filter's size).
func probe(h uint64, i int) (int, byte) {
	bit := (h >> (16 * i)) % digestBits
	return 1 + int(bit/8), 1 << (bit % 8)
}

// valid reports whether d is a digest of this version's layout (a peer's note).
func (d digest) valid() bool { return len(d) == 1+digestBits/8 && d[0] == digestFormat }

func (d digest) has(h uint64) bool {
	for i := range digestProbes {
		if byt, mask := probe(h, i); d[byt]&mask == 0 {
			return false
		}
	}
	return true
}

// fill is the share of d's bits set (0 for a note that is no digest).
func (d digest) fill() float64 {
	if !d.valid() {
		return 0
	}
	set := 0
	for _, b := range d[1:] {
		set += bits.OnesCount8(b)
	}
	return float64(set) / digestBits
}

// blocks is how many of a prompt's blocks, from the first, d holds.
func (d digest) blocks(hashes []uint64) int {
	for i, h := range hashes {
		if !d.has(h) {
			return i
		}
	}
	return len(hashes)
}

// shareDigests gossips this node's digest of prefixes every digestEvery until ctx ends.
// It runs apart from Run's loop: the engine answers between steps, which a long prefill
// makes seconds apart.
func (r *Router) shareDigests(ctx context.Context) {
	if !r.cfg.SharePrefixes {
		return
	}
	t := time.NewTicker(digestEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		hashes, err := r.local.Prefixes(ctx, digestBlocks)
		if err != nil {
			continue // the engine is not running (yet, or any more)
		}
		d := newDigest(hashes)
		r.held.Store(&d)
		if err := r.v.gossip.SetNote(d); err != nil {
			r.log.Warn("prefix digest not gossiped", "err", err)
		}
	}
}

// prefixElsewhere pulls req's prompt's beginning from a peer that holds more of it than
// this node, when the costs say so (see above). Whatever happens, the turn is served here
// after it: it returns req to serve, its prompt's tokens set once it has tokenized it, so
// that the engine does not tokenize it again.
func (r *Router) prefixElsewhere(ctx context.Context, req infer.Request) infer.Request {
	if !r.cfg.SharePrefixes || r.cfg.Role == RolePrefill || req.SessionID == "" || req.PrefillOnly || req.PromptLogprobs ||
		len(req.Continue) > 0 || len(req.Messages) > 0 || r.local.Holds(req.SessionID) {
		return req
	}
	tokens, hashes, err := r.local.PromptPrefixes(req)
	if err != nil {
		return req // the engine refuses it, as it says
	}
	r.pullPrefix(ctx, req, tokens, hashes)
	req.Tokens = tokens
	return req
}

// pullPrefix pulls the beginning of req's prompt, of tokens and block hashes, from the
// peer whose digest shows the most of it, when that is more than this node holds and the
// costs say so.
func (r *Router) pullPrefix(ctx context.Context, req infer.Request, tokens []int32, hashes []uint64) {
	if len(hashes) < minPulledBlocks {
		return
	}
	here := 0
	if d := r.held.Load(); d != nil {
		here = d.blocks(hashes)
	}
	p, blocks := r.v.prefixHolder(hashes)
	if blocks < minPulledBlocks || blocks <= here {
		return
	}
	// The pull carries all n tokens, after the peer prefilled those past the blocks it
	// holds, and saves this node those past the blocks it holds.
	n := min(len(tokens)-1, (blocks+1)*infer.PrefixBlock)
	saved := n - here*infer.PrefixBlock
	if beats, known := r.pullBeatsPrefill(p, n, max(0, n-blocks*infer.PrefixBlock), saved); known && !beats {
		r.prefixes.WithLabelValues("recompute").Inc()
		return
	}
	pre := prefillOnly(req)
	pre.Tokens = tokens[:n]
	start := r.clock.Now()
	if err := r.prefillAndPull(ctx, p, pre, infer.Prefix, saved); err != nil {
		r.prefixes.WithLabelValues("failed").Inc()
		r.log.Warn("prefix pull failed; prefilling here", "peer", p.id, "session", req.SessionID, "err", err)
		return
	}
	r.prefixes.WithLabelValues("ok").Inc()
	r.nowHeld(hashes[:n/infer.PrefixBlock]) // the next conversation that begins so shares it here
	r.log.Debug("prefix pulled", "peer", p.id, "session", req.SessionID, "tokens", n, "blocks shown", blocks, "took", r.clock.Now().Sub(start))
}

// nowHeld adds hashes to this node's digest until the next is computed, so that the
// turns arriving meanwhile see what was just pulled here.
func (r *Router) nowHeld(hashes []uint64) {
	for {
		old := r.held.Load()
		d := newDigest(hashes)
		if old != nil {
			for i := range d {
				d[i] |= (*old)[i]
			}
		}
		if r.held.CompareAndSwap(old, &d) {
			return
		}
	}
}

// prefixHolder is the peer whose digest shows the most of a prompt's blocks, from the
// first (the least loaded of equals), and how many: among the members of this node's
// model that are up by this node's checks, ready, not degraded and with room in their
// queue.
func (v *view) prefixHolder(hashes []uint64) (candidate, int) {
	notes := v.gossip.Notes()
	v.mu.Lock()
	defer v.mu.Unlock()
	var best candidate
	most := 0
	for id, m := range v.members {
		d := digest(notes[m.Name])
		if id == v.cfg.Self || !d.valid() || m.Meta.Fingerprint != v.cfg.Fingerprint || !v.up(id) || !m.Meta.Ready ||
			v.degraded[id] || (m.Meta.QueueCap > 0 && m.Meta.Waiting >= m.Meta.QueueCap) || m.Meta.HopMinor < 7 {
			continue
		}
		c := candidate{id: id, addr: m.Meta.HTTPAddr, load: m.Meta.Running + m.Meta.Waiting, minor: m.Meta.HopMinor,
			prefill: float64(m.Meta.Prefill)}
		if k := d.blocks(hashes); k > most || (k == most && k > 0 && c.load < best.load) {
			best, most = c, k
		}
	}
	return best, most
}

package routing

import (
	"cmp"
	"context"
	"fmt"
	"hash/crc32"
	"log/slog"
	"net/http"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/infernode/infernode/gossip"
	"github.com/infernode/infernode/node/gray"
	"github.com/infernode/infernode/node/hop"
	"github.com/infernode/infernode/node/kvmove"
	"github.com/infernode/infernode/ring"
)

// The view: this node's picture of its peers (gossip membership, its own health checks and
// speed observations, the rings) and the candidates it derives for each key. The Router
// forwards by it.

// view is the membership view a Router routes by.
type view struct {
	cfg    Config
	log    *slog.Logger
	gossip Membership
	local  Engine
	client *http.Client
	clock  Clock

	mu      sync.Mutex
	table   *ring.Table
	members map[string]member        // by stable id: the live incarnation, else the newest
	holder  map[string]string        // id → the live member name that holds it
	refused map[string]bool          // member names refused for claiming a live member's id (logged once)
	down    map[string]chan struct{} // closed when the peer is declared down (see abandonDown)
	names   map[string]string        // model id → its ring (see modelRings), for models served by peers
	decoded map[string]decodedTags   // member name → its tags as last decoded (see record)
	// degraded is the cluster's verdict on gray failures (see speed.go).
	degraded map[string]bool
	speed    *speeds // this node's own verdicts on its peers' speed; taken after mu when both are held

	// probeSick and probeNext are where the next round's checks of peers that are not
	// healthy, and of the others, start (see probeTargets); guarded by mu.
	probeSick, probeNext int
	heirMu               sync.Mutex
	heirRings            map[heirKey]*ring.Ring // the ring without some members (see heirs), guarded by heirMu
	started              time.Time              // when the view was made (see settling)
	settled              atomic.Bool            // it has been ready
	joined               time.Time              // when this node's ring first held another member (see kvmove's pulls)
	left                 map[string]time.Time   // when each member that left gracefully was seen leaving (see leavers)
	ringCh               chan struct{}          // signaled (coalesced) when the ring changes
	events               *happenings
	rate                 decodeRate // tokens a second this node generates, as gossiped
}

// settleGrace bounds how long a starting node waits for the peers gossip shows it to
// join its ring (see settling).
const settleGrace = 10 * time.Second

// serving reports whether a member is alive in gossip and not leaving: one that may serve
// and be checked.
func serving(m member) bool { return m.State == gossip.Alive && !m.Meta.Leaving }

// member is a gossip member with its tags decoded.
type member struct {
	gossip.Member
	Meta Meta
}

// candidate is a peer that may serve a key.
type candidate struct {
	id, addr string
	full     bool    // its gossiped queue is full
	slow     bool    // degraded (see speed.go)
	load     int     // its requests running and waiting, as last gossiped
	minor    int     // the hop minor version it speaks (see hop.MinorFor)
	prefill  float64 // prompt tokens a second it gossips it prefills (a prefill node's, see prefillers)
}

func newView(cfg Config, log *slog.Logger, g Membership, local Engine, client *http.Client, clock Clock) *view {
	return &view{
		cfg: cfg, log: log, gossip: g, local: local, client: client, clock: clock,
		table:    ring.NewTable(cfg.Ring, cfg.Self),
		members:  map[string]member{},
		decoded:  map[string]decodedTags{},
		holder:   map[string]string{},
		refused:  map[string]bool{},
		down:     map[string]chan struct{}{},
		names:    map[string]string{cfg.Model: ""},
		degraded: map[string]bool{},
		left:     map[string]time.Time{},
		speed:    newSpeeds(cfg.Gray, clock, log),
		ringCh:   make(chan struct{}, 1),
		started:  clock.Now(),
		events:   &happenings{now: clock.Now},
		// Each node starts its turns at its own place (see probeTargets).
		probeNext: int(crc32.ChecksumIEEE([]byte(cfg.Self)) % (1 << 20)),
	}
}

// settling reports whether this node, never ready yet and started within settleGrace,
// sees in gossip a ready peer that is not yet on its ring, its first checks to come. Until
// they are, the node would own every conversation it is asked about and serve them cold
// (the chaos suite saw a joining node do that for half a second), so it is not ready:
// peers leave it off their rings and clients go elsewhere. Once ready, a node stays so
// whoever joins after it.
func (v *view) settling() bool {
	if v.settled.Load() || v.clock.Now().Sub(v.started) > settleGrace {
		return false
	}
	return slices.ContainsFunc(v.table.Peers(), func(p ring.Peer) bool { return p.Pending })
}

// incompatible says why a peer cannot share this node's ring, or "" when it can: it
// serves another model (it is on that model's ring), or speaks no hop this node does (it
// is on no ring).
func (v *view) incompatible(m Meta) string {
	switch {
	case !m.Speaks(hop.Major):
		return "hop protocol"
	case m.Fingerprint != v.cfg.Fingerprint:
		return "model"
	}
	return ""
}

// ringOf names the ring of the model a peer serves (see ring.Facts.Model): "" for this
// node's model, else the peer's fingerprint, so that only nodes with the same weights and
// KV layout share a ring.
func (v *view) ringOf(m Meta) string {
	if m.Fingerprint == v.cfg.Fingerprint {
		return ""
	}
	return m.Fingerprint
}

// modelRings maps the model ids that live, compatible peers serve to their rings. Peers
// that serve one id with different fingerprints (another quantization, another KV type)
// cannot share a ring: the id goes to the fingerprint the most peers serve (this node's,
// for its own model). Callers hold mu.
func (v *view) modelRings() map[string]string {
	count := map[[2]string]int{}
	for _, m := range v.members {
		if m.State == gossip.Alive && m.Meta.Model != "" && m.Meta.Speaks(hop.Major) {
			count[[2]string{m.Meta.Model, v.ringOf(m.Meta)}]++
		}
	}
	names := map[string]string{}
	best := map[string]int{}
	for k, n := range count {
		name, key := k[0], k[1]
		if cur, ok := names[name]; !ok || n > best[name] || (n == best[name] && key < cur) {
			names[name], best[name] = key, n
		}
	}
	names[v.cfg.Model] = ""
	return names
}

// Sync folds gossip's member list into the table. Members with invalid metadata are kept
// off the ring. Of two live members claiming one id, the one this node saw first keeps it
// and the other is refused (a restarted node takes its id over once its old incarnation
// is dead or gone).
func (v *view) Sync() {
	v.record(v.gossip.Members())
	v.commit()
}

// decodedTags is a member's tags and what they say.
type decodedTags struct {
	tags string
	meta Meta
}

// decode is what a member's tags say, decoded again only when they changed: a Sync reads
// every member (1,000 JSON decodes cost milliseconds), and most tags change rarely.
// Tags that do not decode are Invalid already. Callers hold mu.
func (v *view) decode(m gossip.Member) Meta {
	if d, ok := v.decoded[m.Name]; ok && d.tags == string(m.Tags) {
		return d.meta
	}
	meta, _ := DecodeMeta(m.Tags)
	v.decoded[m.Name] = decodedTags{string(m.Tags), meta}
	return meta
}

// record folds gossip's members into the table (see Sync).
func (v *view) record(gossiped []gossip.Member) {
	v.mu.Lock()
	defer v.mu.Unlock()
	byID := map[string]member{}
	names := map[string]bool{}
	var dup []member
	for _, gm := range gossiped {
		m := member{Member: gm, Meta: v.decode(gm)}
		names[m.Name] = true
		id := m.Meta.ID
		if m.Invalid != "" || id == "" || id == v.cfg.Self {
			continue
		}
		prev, seen := byID[id]
		switch {
		case !seen:
			byID[id] = m
		case m.State == gossip.Alive && prev.State == gossip.Alive:
			if v.holder[id] == m.Name || (v.holder[id] != prev.Name && m.Name > prev.Name) {
				byID[id], m = m, prev
			}
			dup = append(dup, m)
		case m.State == gossip.Alive || (prev.State != gossip.Alive && m.Name > prev.Name):
			byID[id] = m
		}
	}
	for id := range v.holder {
		if byID[id].State != gossip.Alive {
			delete(v.holder, id)
		}
	}
	for id, m := range byID {
		if m.State == gossip.Alive {
			v.holder[id] = m.Name
		}
	}
	for name := range v.refused {
		if !names[name] { // pruned by gossip: forget it here too
			delete(v.refused, name)
		}
	}
	for name := range v.decoded {
		if !names[name] {
			delete(v.decoded, name)
		}
	}
	for _, m := range dup {
		if !v.refused[m.Name] {
			v.refused[m.Name] = true
			v.log.Warn("refused a member claiming a live member's id", "id", m.Meta.ID, "name", m.Name,
				"holder", byID[m.Meta.ID].Name, "addr", m.Addr)
		}
	}
	for id := range v.members {
		if _, ok := byID[id]; !ok {
			v.table.Forget(id)
		}
	}
	for id, m := range byID {
		old, had := v.members[id]
		switch {
		case serving(m) && (!had || old.State != gossip.Alive):
			v.events.add("join", id, m.Meta.Model)
		case !had || old.State != gossip.Alive || old.Meta.Leaving:
		case m.State == gossip.Dead:
			v.events.add("dead", id, "gossip")
		case m.State == gossip.Left || m.Meta.Leaving:
			v.events.add("leave", id, "")
			v.left[id] = v.clock.Now()
		}
	}
	for id, at := range v.left {
		if m := byID[id]; serving(m) || m.State == gossip.Dead || v.clock.Now().Sub(at) > leaverWindow {
			delete(v.left, id)
		}
	}
	for id, m := range byID {
		if !serving(m) {
			v.table.Forget(id)
		} else {
			// A prefill node is checked like any peer, and owns no conversation: it is
			// never on a ring.
			v.table.SetFacts(id, ring.Facts{Alive: true, Ready: m.Meta.Ready && m.Meta.Role != RolePrefill, Compatible: m.Meta.Speaks(hop.Major), Model: v.ringOf(m.Meta)})
		}
	}
	v.members = byID
	v.names = v.modelRings()
	v.updateDegraded()
}

// commit puts the changes recorded in the table on the ring in one update, built outside
// mu so that lookups never wait for it, then does what a ring change sets off (or, with
// none, abandons forwards to a peer off the ring that went from leaving to dead).
func (v *view) commit() {
	changed := v.table.Commit()
	v.mu.Lock()
	defer v.mu.Unlock()
	if changed {
		v.ringChanged()
	} else {
		v.abandonDown()
	}
}

// ringChanged logs the new ring and abandons forwards to peers declared down. Callers hold
// mu.
func (v *view) ringChanged() {
	members := v.table.Ring().Members()
	v.log.Info("ring changed", "members", members)
	v.events.add("ring", "", fmt.Sprintf("%d on this node's ring", len(members)))
	if v.joined.IsZero() && len(members) > 1 && slices.Contains(members, v.cfg.Self) {
		v.joined = v.clock.Now()
	}
	v.abandonDown()
	select {
	case v.ringCh <- struct{}{}:
	default:
	}
}

// abandonDown cancels the forwards in flight to peers that are off this node's rings for
// any reason but a graceful leave: a leaving peer finishes the streams it serves (it
// drains), while a dead, unhealthy or vanished one may never answer. Callers hold mu.
func (v *view) abandonDown() {
	for id, ch := range v.down {
		m := v.members[id]
		leaving := (m.Meta.Leaving || m.State == gossip.Left) && m.State != gossip.Dead
		if !v.up(id) && !leaving {
			close(ch)
			delete(v.down, id)
		}
	}
}

// up reports whether a peer may be sent work: on this node's rings, or a prefill node
// (on none) alive and healthy by this node's checks. Callers hold mu.
func (v *view) up(id string) bool {
	m := v.members[id]
	return v.table.OnRing(id) || (m.Meta.Role == RolePrefill && serving(m) && v.table.Healthy(id))
}

// downSignal is closed when peer leaves this node's rings (it is already closed if the
// peer is on none now): forwards to a peer that has been declared down give up at once
// instead of waiting on a node that may never answer (a paused process keeps accepting
// connections).
func (v *view) downSignal(peer string) <-chan struct{} {
	v.mu.Lock()
	defer v.mu.Unlock()
	ch, ok := v.down[peer]
	if !ok {
		ch = make(chan struct{})
		if v.up(peer) {
			v.down[peer] = ch
		} else {
			close(ch)
		}
	}
	return ch
}

// ProbeAll checks this round's peers' /readyz at once (see probeTargets) and records the
// outcomes.
func (v *view) ProbeAll(ctx context.Context) {
	targets := v.probeTargets()
	type result struct {
		peer string
		ok   bool
	}
	results := make(chan result, len(targets))
	var wg sync.WaitGroup
	for id, addr := range targets {
		wg.Go(func() {
			start := v.clock.Now()
			ok := v.probe(ctx, addr)
			if ok {
				v.speed.probe(id, v.clock.Now().Sub(start))
			}
			results <- result{id, ok}
		})
	}
	wg.Wait()
	close(results)
	flipped := false
	for res := range results {
		flipped = v.recordCheck(res.peer, res.ok, "probe") || flipped
	}
	if flipped {
		v.commit()
	}
	v.mu.Lock()
	live := map[string]float64{}
	for id, m := range v.members {
		if serving(m) {
			live[id] = float64(m.Meta.Decode)
		}
	}
	v.mu.Unlock()
	if v.speed.judge(live) { // gossiped by the next Publish
		v.mu.Lock()
		v.updateDegraded()
		v.mu.Unlock()
	}
}

// probeTargets are the peers to check this round, id to HTTP address: every live peer
// while they number at most Config.ProbePeers, else that many of them: this node's ring
// neighbours (they take its conversations over if it fails, and it theirs), then peers
// not healthy yet or no longer (so a newcomer joins rings and a recovered peer returns),
// then the others in turn from a place that differs from node to node, so the checks
// of a large cluster do not all land on the same peers at once.
func (v *view) probeTargets() map[string]string {
	rg, peers := v.table.Ring(), v.table.Peers()
	v.mu.Lock()
	defer v.mu.Unlock()
	live := map[string]string{}
	var ids []string
	for id, m := range v.members {
		if serving(m) {
			live[id] = m.Meta.HTTPAddr
			ids = append(ids, id)
		}
	}
	budget := v.cfg.ProbePeers
	if len(live) <= budget {
		return live
	}
	out := make(map[string]string, budget)
	take := func(id string) {
		if addr, ok := live[id]; ok && len(out) < budget {
			out[id] = addr
		}
	}
	for _, id := range rg.Neighbours(v.cfg.Self, v.cfg.Candidates-1) {
		take(id)
	}
	var sick []string
	for _, p := range peers {
		if !p.Healthy && p.Facts.Ready && p.Facts.Compatible {
			sick = append(sick, p.ID)
		}
	}
	slices.Sort(ids)
	for _, group := range []struct {
		ids    []string
		cursor *int
	}{{sick, &v.probeSick}, {ids, &v.probeNext}} {
		for i := 0; i < len(group.ids) && len(out) < budget; i++ {
			take(group.ids[*group.cursor%len(group.ids)])
			*group.cursor++
		}
	}
	return out
}

func (v *view) probe(ctx context.Context, addr string) bool {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	t := v.clock.AfterFunc(v.cfg.ProbeTimeout, cancel)
	defer t.Stop()
	req, err := http.NewRequestWithContext(ctx, "GET", hop.URL(addr, "/readyz"), nil)
	if err != nil {
		return false
	}
	resp, err := v.client.Do(req)
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// observe records one check of peer's health, a probe or a forward's outcome, and
// updates the ring when the peer's health flipped.
func (v *view) observe(peer string, ok bool, by string) {
	if v.recordCheck(peer, ok, by) {
		v.commit()
	}
}

// recordCheck records one check of peer's health and reports whether it flipped; the ring
// follows at the next commit.
func (v *view) recordCheck(peer string, ok bool, by string) bool {
	if !v.table.Observe(peer, ok) {
		return false
	}
	v.log.Info("peer health changed", "peer", peer, "healthy", ok, "by", by)
	v.events.add(map[bool]string{true: "up", false: "down"}[ok], peer, by)
	return true
}

// candidates are the peers to try for key on model's ring (see ringOf): its owner, then
// the next owners least loaded first (by their gossiped load; ring order among equals), so
// a busy owner's work spills where it waits least.
func (v *view) candidates(model, key string) []candidate {
	st := v.local.Stats()
	rg := v.table.RingOf(model)
	if rg == nil {
		return nil
	}
	ids, err := rg.Owners(key, v.cfg.Candidates)
	if err != nil {
		return nil // an empty ring: the caller serves locally
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	if len(ids) > 1 && v.degraded[ids[0]] {
		ids = gray.Aside(key, ids, v.cfg.Gray.Share)
	}
	out := make([]candidate, 0, len(ids))
	for _, id := range ids {
		if id == v.cfg.Self {
			out = append(out, candidate{id: id, slow: v.degraded[id], load: st.Running + st.Waiting, minor: hop.Minor})
			continue
		}
		m := v.members[id].Meta
		out = append(out, candidate{id: id, addr: m.HTTPAddr, full: m.Full(), slow: v.degraded[id], load: m.Running + m.Waiting,
			minor: m.HopMinor})
	}
	if len(out) > 1 {
		// Spill-over goes to a full queue last, and to a degraded member only before that.
		rank := func(c candidate) int {
			switch {
			case c.full:
				return 2
			case c.slow:
				return 1
			}
			return 0
		}
		slices.SortStableFunc(out[1:], func(a, b candidate) int {
			return cmp.Or(cmp.Compare(rank(a), rank(b)), cmp.Compare(a.load, b.load))
		})
	}
	return out
}

// Models lists the models the cluster serves, this node's first, then by id.
func (v *view) Models() []ModelInfo {
	v.mu.Lock()
	defer v.mu.Unlock()
	var out []ModelInfo
	for id, key := range v.names {
		m := ModelInfo{ID: id, Ready: v.table.RingOf(key).Len(), Local: key == ""}
		if m.Local {
			m.Nodes = 1
		}
		for _, p := range v.members {
			if serving(p) && p.Meta.Speaks(hop.Major) && v.ringOf(p.Meta) == key {
				m.Nodes++
			}
		}
		out = append(out, m)
	}
	slices.SortFunc(out, func(a, b ModelInfo) int {
		if a.Local != b.Local {
			if a.Local {
				return -1
			}
			return 1
		}
		return strings.Compare(a.ID, b.ID)
	})
	return out
}

// Serves reports whether a live peer serves model, by the id clients name it with.
func (v *view) Serves(model string) bool {
	_, ok := v.target(model)
	return ok
}

// View returns the cluster as this node sees it, with its ring sampled at points places
// (0: not drawn); ready is whether this node is.
func (v *view) View(points int, ready bool) View {
	st := v.local.Stats()
	selfAddr := v.gossip.Addr()
	notes := v.gossip.Notes()
	v.mu.Lock()
	defer v.mu.Unlock()
	shares := map[string]map[string]float64{}
	shareOf := func(model, id string) float64 {
		if shares[model] == nil {
			shares[model] = v.table.RingOf(model).Shares()
		}
		return shares[model][id]
	}
	out := View{Self: v.cfg.Self, Ring: v.table.Ring().Sample(points)}
	own := shareOf("", v.cfg.Self)
	out.Members = append(out.Members, MemberView{
		ID: v.cfg.Self, HTTPAddr: v.cfg.HTTPAddr, GossipAddr: selfAddr, State: "alive", Healthy: true, Ready: ready,
		Compatible: true, Model: v.cfg.Model, Role: v.cfg.Role, Fingerprint: v.cfg.Fingerprint, Hop: hop.Versions, OnRing: own > 0, RingShare: own,
		Load:       map[string]int{"running": st.Running, "waiting": st.Waiting, "free_kv": st.KVCells - st.KVUsed},
		TokensPerS: int(v.rate.current()),
	})
	out.Members[0].Degraded = v.degraded[v.cfg.Self]
	peers := map[string]ring.Peer{}
	for _, p := range v.table.Peers() {
		peers[p.ID] = p
	}
	for id, m := range v.members {
		p := peers[id]
		state := string(m.State)
		if m.State == gossip.Alive && !p.Healthy {
			state = "suspect"
		}
		if m.Meta.Leaving {
			state = "left"
		}
		why := v.incompatible(m.Meta)
		speed := v.speed.of(id)
		out.Members = append(out.Members, MemberView{
			ID: id, HTTPAddr: m.Meta.HTTPAddr, GossipAddr: m.Addr, State: state, Healthy: p.Healthy, Ready: m.Meta.Ready,
			Compatible: why == "", Reason: why, Model: m.Meta.Model, Role: cmp.Or(m.Meta.Role, RoleBoth), Fingerprint: m.Meta.Fingerprint, Hop: m.Meta.Hop,
			OnRing: v.table.OnRing(id), RingShare: shareOf(v.ringOf(m.Meta), id),
			Load:       map[string]int{"running": m.Meta.Running, "waiting": m.Meta.Waiting, "free_kv": m.Meta.FreeKV},
			TokensPerS: m.Meta.Decode, Degraded: v.degraded[id], SlowHere: speed.Slow, ProbeMS: speed.ProbeMS,
			PrefixDigest: digest(notes[m.Name]).fill(),
		})
	}
	slices.SortFunc(out.Members[1:], func(a, b MemberView) int { return strings.Compare(a.ID, b.ID) })
	return out
}

// peer reports whether ip is a member's gossip address (memberlist learnt it from the
// member's own, encrypted, packets) or the API address it gossips.
func (v *view) peer(ip netip.Addr) bool {
	v.mu.Lock()
	defer v.mu.Unlock()
	for id, m := range v.members {
		if id == v.cfg.Self {
			continue
		}
		for _, a := range []string{m.Addr, m.Meta.HTTPAddr} {
			if ap, err := netip.ParseAddrPort(a); err == nil && ap.Addr().Unmap() == ip.Unmap() {
				return true
			}
		}
	}
	return false
}

// leaverWindow is how long a member that left gracefully is taken to be draining and
// handing off: a drain and the hand-off after it take at most node's drain timeout twice.
const leaverWindow = time.Minute

// leavers are the members of this node's model that left gracefully within leaverWindow
// and have not died or come back since: they finish their streams and hand their caches
// off, and answer pulls for them meanwhile. Sorted by id.
func (v *view) leavers() []candidate {
	v.mu.Lock()
	defer v.mu.Unlock()
	var out []candidate
	for id := range v.left {
		if m := v.members[id]; m.Meta.HTTPAddr != "" && v.ringOf(m.Meta) == "" {
			out = append(out, candidate{id: id, addr: m.Meta.HTTPAddr, minor: m.Meta.HopMinor})
		}
	}
	slices.SortFunc(out, func(a, b candidate) int { return strings.Compare(a.id, b.id) })
	return out
}

// heirs are up to n members that would own key in turn once the nodes gone (by default
// this one) have left or failed: the owner on this node's ring without them, then the
// owner without that one too, and so on. (Not simply the next ones of Owners: the ring
// reassigns a leaving member's partitions by load, not by successor.)
func (v *view) heirs(key string, n int, gone ...string) []candidate {
	if len(gone) == 0 {
		gone = []string{v.cfg.Self}
	}
	base := v.table.Ring()
	gone = slices.Clone(gone)
	var ids []string
	for len(ids) < n {
		id, ok := v.ringWithout(base, gone).Owner(key)
		if !ok {
			break
		}
		ids, gone = append(ids, id), append(gone, id)
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	out := make([]candidate, len(ids))
	for i, id := range ids {
		m := v.members[id].Meta
		out[i] = candidate{id: id, addr: m.HTTPAddr, minor: m.HopMinor}
	}
	return out
}

// ringWithout is base without the members gone, cached with the other heirs' rings (one
// Apply at 1,000 peers costs milliseconds: see docs/SCALE.md).
func (v *view) ringWithout(base *ring.Ring, gone []string) *ring.Ring {
	k := heirKey{base, strings.Join(gone, "\x00")}
	v.heirMu.Lock()
	defer v.heirMu.Unlock()
	rg := v.heirRings[k]
	if rg == nil {
		if len(v.heirRings) >= 4*kvmove.MaxReplicas || v.heirRings == nil {
			v.heirRings = map[heirKey]*ring.Ring{} // most are of rings that have changed since
		}
		rg = base.Apply(nil, gone)
		v.heirRings[k] = rg
	}
	return rg
}

// updateDegraded recomputes the cluster's verdict from gossip, and when it changed, says
// so and signals a ring change (conversations move). Callers hold mu.
func (v *view) updateDegraded() {
	var others []gray.Observer
	for _, m := range v.members {
		if serving(m) {
			others = append(others, gray.Observer{ID: m.Meta.ID, Slow: m.Meta.Slow})
		}
	}
	next := gray.Degraded(v.speed.slow(), others)
	for id := range next {
		if !v.degraded[id] {
			v.log.Warn("member degraded: it keeps a reduced share of conversations", "member", id, "share", v.cfg.Gray.Share)
			v.events.add("degraded", id, "")
		}
	}
	for id := range v.degraded {
		if !next[id] {
			v.log.Info("member restored", "member", id)
			v.events.add("restored", id, "")
		}
	}
	if len(next) != len(v.degraded) || !sameKeys(next, v.degraded) {
		v.degraded = next
		select {
		case v.ringCh <- struct{}{}:
		default:
		}
	}
}

// target finds the ring of the model clients call name.
func (v *view) target(name string) (target, bool) {
	v.mu.Lock()
	defer v.mu.Unlock()
	key, ok := v.names[name]
	return target{name: name, ring: key}, ok
}

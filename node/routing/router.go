package routing

import (
	"cmp"
	"context"
	"fmt"
	"hash/crc32"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/infernode/infernode/gossip"
	"github.com/infernode/infernode/node/gray"
	"github.com/infernode/infernode/node/hop"
	"github.com/infernode/infernode/node/kvmove"
	"github.com/infernode/infernode/ring"
	"github.com/infernode/infernode/session/infer"
)

// Membership is what routing needs of gossip. *gossip.Gossip implements it. Its methods
// are safe for concurrent use and do not block.
type Membership interface {
	// Members is a snapshot of every member known, this node included.
	Members() []gossip.Member
	// Changes signals (coalesced) that Members may have changed.
	Changes() <-chan struct{}
	// SetMeta replaces this node's gossiped metadata.
	SetMeta(gossip.Meta) error
	// Joined reports whether this node has joined its cluster.
	Joined() bool
	// Addr is this node's gossip address.
	Addr() string
}

// Engine is what routing needs of the local inference engine: serving, and (for kvmove)
// moving conversations' KV. Implementations are safe for concurrent use.
type Engine interface {
	Submit(ctx context.Context, req infer.Request) (infer.Stream, error)
	Ready() bool
	kvmove.Local
}

var _ Membership = (*gossip.Gossip)(nil)

// Router is one node's view of its peers (gossip membership, its own health checks, the
// ring) and the routing of requests to the owners of their conversations.
type Router struct {
	cfg    Config
	log    *slog.Logger
	gossip Membership
	local  Engine
	client *http.Client
	clock  Clock
	hop    *hop.Auth

	mu      sync.Mutex
	table   *ring.Table
	members map[string]gossip.Member // by stable id: the live incarnation, else the newest
	holder  map[string]string        // id → the live member name that holds it
	refused map[string]bool          // member names refused for claiming a live member's id (logged once)
	down    map[string]chan struct{} // closed when the peer is declared down (see abandonDown)
	names   map[string]string        // model id → its ring (see modelRings), for models served by peers
	// degraded is the cluster's verdict on gray failures (see speed.go).
	degraded map[string]bool
	speedMu  sync.Mutex     // guards speed; taken after mu when both are held
	speed    *gray.Detector // this node's own verdicts on its peers' speed

	// probeSick and probeNext are where the next round's checks of peers that are not
	// healthy, and of the others, start (see probeTargets); guarded by mu.
	probeSick, probeNext int
	heirMu               sync.Mutex
	heirRings            map[heirKey]*ring.Ring // the ring without some members (see heirs), guarded by heirMu
	started              time.Time              // when the router was made (see settling)
	settled              atomic.Bool            // it has been ready
	joined               time.Time              // when this node's ring first held another member (see kvmove's pulls)
	ringCh               chan struct{}          // signaled (coalesced) when the ring changes
	events               happenings
	rate                 decodeRate // tokens a second this node generates, as gossiped

	forwards  *prometheus.CounterVec
	resumes   prometheus.Counter
	ringSize  prometheus.GaugeFunc
	degradedN prometheus.GaugeFunc
	kv        *kvmove.Mover
}

// New builds a router. It starts nothing: Run does.
func New(cfg Config, g Membership, local Engine) (*Router, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	clock := cfg.Clock
	if clock == nil {
		clock = realClock{}
	}
	transport := cfg.Transport
	if transport == nil {
		transport = &http.Transport{
			DialContext:         (&net.Dialer{Timeout: cfg.ConnectTimeout, KeepAlive: 30 * time.Second}).DialContext,
			MaxIdleConnsPerHost: 64,
			IdleConnTimeout:     10 * time.Second, // a burst's extra connections close soon after it
		}
	}
	r := &Router{
		cfg: cfg, log: log.With("component", "routing", "node", cfg.Self), gossip: g, local: local,
		client: &http.Client{Transport: transport}, clock: clock, hop: hop.NewAuth(cfg.Self, cfg.Secret, cfg.AcceptSecrets, clock.Now, cfg.MaxSkew),
		table:    ring.NewTable(cfg.Ring, cfg.Self),
		members:  map[string]gossip.Member{},
		holder:   map[string]string{},
		refused:  map[string]bool{},
		down:     map[string]chan struct{}{},
		names:    map[string]string{cfg.Model: ""},
		degraded: map[string]bool{},
		speed:    gray.NewDetector(cfg.Gray),
		ringCh:   make(chan struct{}, 1),
		started:  clock.Now(),
		// Each node starts its turns at its own place (see probeTargets).
		probeNext: int(crc32.ChecksumIEEE([]byte(cfg.Self)) % (1 << 20)),
		forwards: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "infernode_forwards_total", Help: "Requests forwarded to their owner, by outcome.",
		}, []string{"outcome"}),
		resumes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "infernode_resumes_total", Help: "Streams resumed on another owner after theirs died mid-answer.",
		}),
	}
	r.ringSize = prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "infernode_ring_members", Help: "Peers on this node's ring, itself included.",
	}, func() float64 { return float64(r.table.Ring().Len()) })
	r.degradedN = prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "infernode_degraded_members", Help: "Members the cluster finds slow (gray failures), as this node sees it.",
	}, func() float64 {
		r.mu.Lock()
		defer r.mu.Unlock()
		return float64(len(r.degraded))
	})
	kv := cfg.KV
	if kv.Logger == nil {
		kv.Logger = r.log
	}
	var err error
	if r.kv, err = kvmove.New(kv, kvRing{r}, local, r.hop, r.client, clock.Now); err != nil {
		return nil, err
	}
	if len(cfg.Secret) == 0 {
		r.log.Warn("hops are not authenticated (insecure): anyone who reaches this node's HTTP port can submit raw requests as a peer")
	}
	return r, nil
}

// Collectors are the router's Prometheus metrics.
func (r *Router) Collectors() []prometheus.Collector {
	return append([]prometheus.Collector{r.forwards, r.resumes, r.ringSize, r.degradedN}, r.kv.Collectors()...)
}

// KeepAlive is how often this node, as an owner, tells an entry node that a forwarded
// request without a token yet is still in hand.
func (r *Router) KeepAlive() time.Duration { return r.cfg.KeepAlive }

// Ready reports whether this node may be on rings: model ready and gossip joined.
func (r *Router) Ready() (bool, string) {
	switch {
	case !r.local.Ready():
		return false, "model loading or engine stopped"
	case !r.gossip.Joined():
		return false, "gossip has not joined the cluster yet"
	case r.settling():
		return false, "peers are not on this node's ring yet"
	}
	r.settled.Store(true)
	return true, ""
}

// settleGrace bounds how long a starting node waits for the peers gossip shows it to
// join its ring (see settling).
const settleGrace = 10 * time.Second

// settling reports whether this node, never ready yet and started within settleGrace,
// sees in gossip a ready peer that is not yet on its ring, its first checks to come. Until
// they are, the node would own every conversation it is asked about and serve them cold
// (the chaos suite saw a joining node do that for half a second), so it is not ready:
// peers leave it off their rings and clients go elsewhere. Once ready, a node stays so
// whoever joins after it.
func (r *Router) settling() bool {
	if r.settled.Load() || r.clock.Now().Sub(r.started) > settleGrace {
		return false
	}
	return slices.ContainsFunc(r.table.Peers(), func(p ring.Peer) bool { return p.Pending })
}

// syncDelay is how long the first of a burst of membership changes (a join storm, a
// partition healing) waits for the rest, so the burst is one ring update.
const syncDelay = 50 * time.Millisecond

// Run follows membership, checks peers and gossips this node's state until ctx ends.
func (r *Router) Run(ctx context.Context) error {
	go r.kv.FollowRing(ctx, r.ringCh)
	probe := time.NewTicker(r.cfg.ProbeInterval)
	defer probe.Stop()
	var burst <-chan time.Time // set while a burst of membership changes gathers
	for {
		r.Publish()
		select {
		case <-ctx.Done():
			return nil
		case <-r.gossip.Changes():
			if burst == nil {
				burst = time.After(syncDelay)
			}
		case <-burst:
			burst = nil
			r.Sync()
		case <-probe.C:
			r.Sync()
			r.ProbeAll(ctx)
		}
	}
}

// Publish gossips this node's readiness and load, and puts it on its own ring when ready.
func (r *Router) Publish() {
	ready, _ := r.Ready()
	st := r.local.Stats()
	err := r.gossip.SetMeta(gossip.Meta{
		ID: r.cfg.Self, HTTPAddr: r.cfg.HTTPAddr, Fingerprint: r.cfg.Fingerprint, Model: r.cfg.Model, Ready: ready, Hop: hop.Versions,
		Running: st.Running, Waiting: st.Waiting, FreeKV: st.KVCells - st.KVUsed, QueueCap: r.cfg.QueueCap,
		Prefill: int(st.PrefillRate), Decode: int(r.rate.update(r.clock.Now(), st.Generated)), Slow: r.slowPeers(),
	})
	if err != nil {
		r.log.Error("cannot gossip metadata", "err", err)
	}
	if r.table.SetSelfReady(ready) {
		r.commit()
	}
}

// serving reports whether a member is alive in gossip and not leaving: one that may serve
// and be checked.
func serving(m gossip.Member) bool { return m.State == gossip.Alive && !m.Meta.Leaving }

// incompatible says why a peer cannot share this node's ring, or "" when it can: it
// serves another model (it is on that model's ring), or speaks no hop this node does (it
// is on no ring).
func (r *Router) incompatible(m gossip.Meta) string {
	switch {
	case !m.Speaks(hop.Major):
		return "hop protocol"
	case m.Fingerprint != r.cfg.Fingerprint:
		return "model"
	}
	return ""
}

// ringOf names the ring of the model a peer serves (see ring.Facts.Model): "" for this
// node's model, else the peer's fingerprint, so that only nodes with the same weights and
// KV layout share a ring.
func (r *Router) ringOf(m gossip.Meta) string {
	if m.Fingerprint == r.cfg.Fingerprint {
		return ""
	}
	return m.Fingerprint
}

// modelRings maps the model ids that live, compatible peers serve to their rings. Peers
// that serve one id with different fingerprints (another quantization, another KV type)
// cannot share a ring: the id goes to the fingerprint the most peers serve (this node's,
// for its own model). Callers hold mu.
func (r *Router) modelRings() map[string]string {
	count := map[[2]string]int{}
	for _, m := range r.members {
		if m.State == gossip.Alive && m.Meta.Model != "" && m.Meta.Speaks(hop.Major) {
			count[[2]string{m.Meta.Model, r.ringOf(m.Meta)}]++
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
	names[r.cfg.Model] = ""
	return names
}

// Sync folds gossip's member list into the table. Members with invalid metadata are kept
// off the ring. Of two live members claiming one id, the one this node saw first keeps it
// and the other is refused (a restarted node takes its id over once its old incarnation
// is dead or gone).
func (r *Router) Sync() {
	r.record(r.gossip.Members())
	r.commit()
}

// record folds gossip's members into the table (see Sync).
func (r *Router) record(members []gossip.Member) {
	r.mu.Lock()
	defer r.mu.Unlock()
	byID := map[string]gossip.Member{}
	names := map[string]bool{}
	var dup []gossip.Member
	for _, m := range members {
		names[m.Name] = true
		id := m.Meta.ID
		if m.Invalid != "" || id == "" || id == r.cfg.Self {
			continue
		}
		prev, seen := byID[id]
		switch {
		case !seen:
			byID[id] = m
		case m.State == gossip.Alive && prev.State == gossip.Alive:
			if r.holder[id] == m.Name || (r.holder[id] != prev.Name && m.Name > prev.Name) {
				byID[id], m = m, prev
			}
			dup = append(dup, m)
		case m.State == gossip.Alive || (prev.State != gossip.Alive && m.Name > prev.Name):
			byID[id] = m
		}
	}
	for id := range r.holder {
		if byID[id].State != gossip.Alive {
			delete(r.holder, id)
		}
	}
	for id, m := range byID {
		if m.State == gossip.Alive {
			r.holder[id] = m.Name
		}
	}
	for name := range r.refused {
		if !names[name] { // pruned by gossip: forget it here too
			delete(r.refused, name)
		}
	}
	for _, m := range dup {
		if !r.refused[m.Name] {
			r.refused[m.Name] = true
			r.log.Warn("refused a member claiming a live member's id", "id", m.Meta.ID, "name", m.Name,
				"holder", byID[m.Meta.ID].Name, "addr", m.Addr)
		}
	}
	for id := range r.members {
		if _, ok := byID[id]; !ok {
			r.table.Forget(id)
		}
	}
	for id, m := range byID {
		old, had := r.members[id]
		switch {
		case serving(m) && (!had || old.State != gossip.Alive):
			r.happened("join", id, m.Meta.Model)
		case !had || old.State != gossip.Alive || old.Meta.Leaving:
		case m.State == gossip.Dead:
			r.happened("dead", id, "gossip")
		case m.State == gossip.Left || m.Meta.Leaving:
			r.happened("leave", id, "")
		}
	}
	for id, m := range byID {
		if !serving(m) {
			r.table.Forget(id)
		} else {
			r.table.SetFacts(id, ring.Facts{Alive: true, Ready: m.Meta.Ready, Compatible: m.Meta.Speaks(hop.Major), Model: r.ringOf(m.Meta)})
		}
	}
	r.members = byID
	r.names = r.modelRings()
	r.updateDegraded()
}

// commit puts the changes recorded in the table on the ring in one update, built outside
// mu so that lookups never wait for it, then does what a ring change sets off (or, with
// none, abandons forwards to a peer off the ring that went from leaving to dead).
func (r *Router) commit() {
	changed := r.table.Commit()
	r.mu.Lock()
	defer r.mu.Unlock()
	if changed {
		r.ringChanged()
	} else {
		r.abandonDown()
	}
}

// ringChanged logs the new ring and abandons forwards to peers declared down. Callers hold
// mu.
func (r *Router) ringChanged() {
	members := r.table.Ring().Members()
	r.log.Info("ring changed", "members", members)
	r.happened("ring", "", fmt.Sprintf("%d on this node's ring", len(members)))
	if r.joined.IsZero() && len(members) > 1 && slices.Contains(members, r.cfg.Self) {
		r.joined = r.clock.Now()
	}
	r.abandonDown()
	select {
	case r.ringCh <- struct{}{}:
	default:
	}
}

// abandonDown cancels the forwards in flight to peers that are off this node's rings for
// any reason but a graceful leave: a leaving peer finishes the streams it serves (it
// drains), while a dead, unhealthy or vanished one may never answer. Callers hold mu.
func (r *Router) abandonDown() {
	for id, ch := range r.down {
		m := r.members[id]
		leaving := (m.Meta.Leaving || m.State == gossip.Left) && m.State != gossip.Dead
		if !r.table.OnRing(id) && !leaving {
			close(ch)
			delete(r.down, id)
		}
	}
}

// downSignal is closed when peer leaves this node's rings (it is already closed if the
// peer is on none now): forwards to a peer that has been declared down give up at once
// instead of waiting on a node that may never answer (a paused process keeps accepting
// connections).
func (r *Router) downSignal(peer string) <-chan struct{} {
	r.mu.Lock()
	defer r.mu.Unlock()
	ch, ok := r.down[peer]
	if !ok {
		ch = make(chan struct{})
		if r.table.OnRing(peer) {
			r.down[peer] = ch
		} else {
			close(ch)
		}
	}
	return ch
}

// ProbeAll checks this round's peers' /readyz at once (see probeTargets) and records the
// outcomes.
func (r *Router) ProbeAll(ctx context.Context) {
	targets := r.probeTargets()
	type result struct {
		peer string
		ok   bool
	}
	results := make(chan result, len(targets))
	var wg sync.WaitGroup
	for id, addr := range targets {
		wg.Go(func() {
			start := r.clock.Now()
			ok := r.probe(ctx, addr)
			if ok {
				r.observeProbe(id, r.clock.Now().Sub(start))
			}
			results <- result{id, ok}
		})
	}
	wg.Wait()
	close(results)
	flipped := false
	for res := range results {
		flipped = r.recordCheck(res.peer, res.ok, "probe") || flipped
	}
	if flipped {
		r.commit()
	}
	r.mu.Lock()
	var live []string
	for id, m := range r.members {
		if serving(m) {
			live = append(live, id)
		}
	}
	r.mu.Unlock()
	if r.judgeSpeeds(live) { // gossiped by the next Publish
		r.mu.Lock()
		r.updateDegraded()
		r.mu.Unlock()
	}
}

// probeTargets are the peers to check this round, id to HTTP address: every live peer
// while they number at most Config.ProbePeers, else that many of them: this node's ring
// neighbours (they take its conversations over if it fails, and it theirs), then peers
// not healthy yet or no longer (so a newcomer joins rings and a recovered peer returns),
// then the others in turn from a place that differs from node to node, so the checks
// of a large cluster do not all land on the same peers at once.
func (r *Router) probeTargets() map[string]string {
	rg, peers := r.table.Ring(), r.table.Peers()
	r.mu.Lock()
	defer r.mu.Unlock()
	live := map[string]string{}
	var ids []string
	for id, m := range r.members {
		if serving(m) {
			live[id] = m.Meta.HTTPAddr
			ids = append(ids, id)
		}
	}
	budget := r.cfg.ProbePeers
	if len(live) <= budget {
		return live
	}
	out := make(map[string]string, budget)
	take := func(id string) {
		if addr, ok := live[id]; ok && len(out) < budget {
			out[id] = addr
		}
	}
	for _, id := range rg.Neighbours(r.cfg.Self, r.cfg.Candidates-1) {
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
	}{{sick, &r.probeSick}, {ids, &r.probeNext}} {
		for i := 0; i < len(group.ids) && len(out) < budget; i++ {
			take(group.ids[*group.cursor%len(group.ids)])
			*group.cursor++
		}
	}
	return out
}

func (r *Router) probe(ctx context.Context, addr string) bool {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	t := r.clock.AfterFunc(r.cfg.ProbeTimeout, cancel)
	defer t.Stop()
	req, err := http.NewRequestWithContext(ctx, "GET", hop.URL(addr, "/readyz"), nil)
	if err != nil {
		return false
	}
	resp, err := r.client.Do(req)
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// observe records one check of peer's health, a probe or a forward's outcome, and
// updates the ring when the peer's health flipped.
func (r *Router) observe(peer string, ok bool, by string) {
	if r.recordCheck(peer, ok, by) {
		r.commit()
	}
}

// recordCheck records one check of peer's health and reports whether it flipped; the ring
// follows at the next commit.
func (r *Router) recordCheck(peer string, ok bool, by string) bool {
	if !r.table.Observe(peer, ok) {
		return false
	}
	r.log.Info("peer health changed", "peer", peer, "healthy", ok, "by", by)
	r.happened(map[bool]string{true: "up", false: "down"}[ok], peer, by)
	return true
}

// candidate is a peer that may serve a key.
type candidate struct {
	id, addr string
	full     bool // its gossiped queue is full
	slow     bool // degraded (see speed.go)
	load     int  // its requests running and waiting, as last gossiped
}

// candidates are the peers to try for key on model's ring (see ringOf): its owner, then
// the next owners least loaded first (by their gossiped load; ring order among equals), so
// a busy owner's work spills where it waits least.
func (r *Router) candidates(model, key string) []candidate {
	st := r.local.Stats()
	rg := r.table.RingOf(model)
	if rg == nil {
		return nil
	}
	ids, err := rg.Owners(key, r.cfg.Candidates)
	if err != nil {
		return nil // an empty ring: the caller serves locally
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(ids) > 1 && r.degraded[ids[0]] {
		ids = gray.Aside(key, ids, r.cfg.Gray.Share)
	}
	out := make([]candidate, 0, len(ids))
	for _, id := range ids {
		if id == r.cfg.Self {
			out = append(out, candidate{id: id, slow: r.degraded[id], load: st.Running + st.Waiting})
			continue
		}
		m := r.members[id].Meta
		out = append(out, candidate{id: id, addr: m.HTTPAddr, full: m.Full(), slow: r.degraded[id], load: m.Running + m.Waiting})
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

// ModelInfo is one model the cluster serves, as this node sees it.
type ModelInfo struct {
	ID    string
	Nodes int  // live nodes that serve it (this one included, for its own)
	Ready int  // those on its ring here: ready, and healthy by this node's checks
	Local bool // this node serves it
}

// Models lists the models the cluster serves, this node's first, then by id.
func (r *Router) Models() []ModelInfo {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []ModelInfo
	for id, key := range r.names {
		m := ModelInfo{ID: id, Ready: r.table.RingOf(key).Len(), Local: key == ""}
		if m.Local {
			m.Nodes = 1
		}
		for _, p := range r.members {
			if serving(p) && p.Meta.Speaks(hop.Major) && r.ringOf(p.Meta) == key {
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
func (r *Router) Serves(model string) bool {
	_, ok := r.target(model)
	return ok
}

// View is the cluster as this node sees it (GET /v1/cluster).
type View struct {
	Self    string       `json:"self"`
	Members []MemberView `json:"members"`
	// Ring is this node's ring drawn coarsely: the owner at each of a number of points
	// evenly spaced around it (View's argument; none by default).
	Ring []string `json:"ring,omitempty"`
}

// MemberView is one member in View.
type MemberView struct {
	ID          string         `json:"id"`
	HTTPAddr    string         `json:"http_addr"`
	GossipAddr  string         `json:"gossip_addr"`
	State       string         `json:"state"` // alive, suspect (alive in gossip, failing checks), dead, left
	Healthy     bool           `json:"healthy"`
	Ready       bool           `json:"ready"`
	Compatible  bool           `json:"compatible"`             // may share this node's ring
	Reason      string         `json:"incompatible,omitempty"` // what differs: "model" or "hop protocol"
	Model       string         `json:"model"`                  // the model it serves, as clients name it
	Fingerprint string         `json:"fingerprint"`            // model and KV-layout fingerprint
	Hop         []int          `json:"hop"`                    // hop protocol major versions spoken
	OnRing      bool           `json:"on_ring"`                // on its model's ring, here
	RingShare   float64        `json:"ring_share"`             // of its model's ring
	Load        map[string]int `json:"load"`
	TokensPerS  int            `json:"tokens_per_second"` // generated lately
	// Degraded: most of the cluster finds it slow (a gray failure; see gray.go). SlowHere:
	// this node does. ProbeMS: the moving average of this node's probes of it.
	Degraded bool    `json:"degraded"`
	SlowHere bool    `json:"slow_here,omitempty"`
	ProbeMS  float64 `json:"probe_ms,omitempty"`
}

// View returns the cluster as this node sees it, with its ring sampled at points places
// (0: not drawn).
func (r *Router) View(points int) View {
	ready, _ := r.Ready()
	st := r.local.Stats()
	selfAddr := r.gossip.Addr()
	r.mu.Lock()
	defer r.mu.Unlock()
	shares := map[string]map[string]float64{}
	shareOf := func(model, id string) float64 {
		if shares[model] == nil {
			shares[model] = r.table.RingOf(model).Shares()
		}
		return shares[model][id]
	}
	v := View{Self: r.cfg.Self, Ring: r.table.Ring().Sample(points)}
	own := shareOf("", r.cfg.Self)
	v.Members = append(v.Members, MemberView{
		ID: r.cfg.Self, HTTPAddr: r.cfg.HTTPAddr, GossipAddr: selfAddr, State: "alive", Healthy: true, Ready: ready,
		Compatible: true, Model: r.cfg.Model, Fingerprint: r.cfg.Fingerprint, Hop: hop.Versions, OnRing: own > 0, RingShare: own,
		Load:       map[string]int{"running": st.Running, "waiting": st.Waiting, "free_kv": st.KVCells - st.KVUsed},
		TokensPerS: int(r.rate.current()),
	})
	v.Members[0].Degraded = r.degraded[r.cfg.Self]
	peers := map[string]ring.Peer{}
	for _, p := range r.table.Peers() {
		peers[p.ID] = p
	}
	for id, m := range r.members {
		p := peers[id]
		state := string(m.State)
		if m.State == gossip.Alive && !p.Healthy {
			state = "suspect"
		}
		if m.Meta.Leaving {
			state = "left"
		}
		why := r.incompatible(m.Meta)
		speed := r.speedOf(id)
		v.Members = append(v.Members, MemberView{
			ID: id, HTTPAddr: m.Meta.HTTPAddr, GossipAddr: m.Addr, State: state, Healthy: p.Healthy, Ready: m.Meta.Ready,
			Compatible: why == "", Reason: why, Model: m.Meta.Model, Fingerprint: m.Meta.Fingerprint, Hop: m.Meta.Hop,
			OnRing: p.OnRing, RingShare: shareOf(r.ringOf(m.Meta), id),
			Load:       map[string]int{"running": m.Meta.Running, "waiting": m.Meta.Waiting, "free_kv": m.Meta.FreeKV},
			TokensPerS: m.Meta.Decode, Degraded: r.degraded[id], SlowHere: speed.Slow, ProbeMS: speed.ProbeMS,
		})
	}
	slices.SortFunc(v.Members[1:], func(a, b MemberView) int { return strings.Compare(a.ID, b.ID) })
	return v
}

// Hop is this node's end of the hop's authentication: node verifies with it what peers send.
func (r *Router) Hop() *hop.Auth { return r.hop }

package routing

import (
	"context"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/infernode/infernode/gossip"
	"github.com/infernode/infernode/node/answers"
	"github.com/infernode/infernode/node/hop"
	"github.com/infernode/infernode/node/kvmove"
	"github.com/infernode/infernode/node/quota"
	"github.com/infernode/infernode/node/stored"
	"github.com/infernode/infernode/session/infer"
)

// Membership is what routing needs of gossip. *gossip.Gossip implements it. Its methods
// are safe for concurrent use and do not block.
type Membership interface {
	// Members is a snapshot of every member known, this node included.
	Members() []gossip.Member
	// Changes signals (coalesced) that Members may have changed.
	Changes() <-chan struct{}
	// SetTags replaces this node's gossiped tags (its Meta, encoded).
	SetTags([]byte) error
	// SetNote replaces this node's gossiped note (its digest of prefixes, see prefix.go);
	// Notes are the members' latest, by member name.
	SetNote([]byte) error
	Notes() map[string][]byte
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
	// Prefixes are the hashes of the prompt beginnings held here, in blocks, at most
	// limit; PromptPrefixes a request's prompt as tokens and the hashes of its blocks (see
	// session's prefix digests).
	Prefixes(ctx context.Context, limit int) ([]uint64, error)
	PromptPrefixes(req infer.Request) ([]int32, []uint64, error)
	// Owns reports whether a conversation has KV here as this node's own, not as a
	// replica kept for another node.
	Owns(key string) bool
	kvmove.Local
}

var _ Membership = (*gossip.Gossip)(nil)

// Router routes requests to the owners of their conversations by this node's view of its
// peers, and moves their KV (kvmove).
type Router struct {
	cfg    Config
	log    *slog.Logger
	local  Engine
	client *http.Client
	clock  Clock
	hop    *hop.Auth
	v      *view
	kv     *kvmove.Mover
	stored *stored.Keeper
	quota  *quota.Quota
	// answers keeps whole answers to the greedy requests that ask (see node/answers).
	answers *answers.Cache
	scale   *autoscaler
	placed  placed // where this node, as owner, placed conversations (see place.go)

	forwards  *prometheus.CounterVec
	prefills  *prometheus.CounterVec // prompts prefilled elsewhere (see prefill.go), by outcome
	prefixes  *prometheus.CounterVec // prompt beginnings pulled from a peer that held them (see prefix.go), by outcome
	held      atomic.Pointer[digest] // the digest of the prefixes held here, as last gossiped
	resumes   prometheus.Counter
	ringSize  prometheus.GaugeFunc
	degradedN prometheus.GaugeFunc
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
	transport, kvTransport := cfg.Transport, cfg.Transport
	if transport == nil {
		dial := (&net.Dialer{Timeout: cfg.ConnectTimeout, KeepAlive: 30 * time.Second}).DialContext
		transport = &http.Transport{
			DialContext:         dial,
			MaxIdleConnsPerHost: 64,
			IdleConnTimeout:     10 * time.Second, // a burst's extra connections close soon after it
		}
		// KV frames go over connections of their own, one a transfer at most, kept open
		// between transfers and closed before the peer's idle timeout. (They were kept
		// first because fasthttp kept a connection's body buffer between its requests, and
		// in fresh memory a 27 MB push took 300-600 ms on loopback instead of 60: the
		// pages' first touch, not the copy. A node now reads frames into buffers of its
		// own, kept whatever the connection: see node's handleKV.)
		kvTransport = &http.Transport{
			DialContext:         dial,
			MaxIdleConnsPerHost: cfg.KV.Transfers,
			IdleConnTimeout:     time.Minute,
			WriteBufferSize:     64 << 10,
			ReadBufferSize:      64 << 10,
		}
	}
	client := &http.Client{Transport: transport}
	// The router's parts name their own component (one "component" key a record).
	parts := log.With("node", cfg.Self)
	log = parts.With("component", "routing")
	r := &Router{
		cfg: cfg, log: log, local: local, client: client, clock: clock,
		hop: hop.NewAuth(cfg.Self, cfg.Secret, cfg.AcceptSecrets, clock.Now, cfg.MaxSkew),
		v:   newView(cfg, log, g, local, client, clock),
		forwards: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "infernode_forwards_total", Help: "Requests forwarded to their owner, by outcome.",
		}, []string{"outcome"}),
		prefills: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "infernode_remote_prefills_total", Help: "Prompts this node had a prefill node prefill, by outcome: ok, failed (prefilled here instead), recompute (a local prefill was sooner).",
		}, []string{"outcome"}),
		prefixes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "infernode_prefix_pulls_total", Help: "New conversations whose prompt beginning this node pulled from a peer that held it, by outcome: ok, failed (prefilled here instead), recompute (a local prefill was sooner).",
		}, []string{"outcome"}),
		resumes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "infernode_resumes_total", Help: "Streams resumed on another owner after theirs died mid-answer.",
		}),
	}
	r.ringSize = prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "infernode_ring_members", Help: "Peers on this node's ring, itself included.",
	}, func() float64 { return float64(r.v.table.Ring().Len()) })
	r.degradedN = prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "infernode_degraded_members", Help: "Members the cluster finds slow (gray failures), as this node sees it.",
	}, func() float64 {
		r.v.mu.Lock()
		defer r.v.mu.Unlock()
		return float64(len(r.v.degraded))
	})
	r.answers = answers.New(cfg.Answers, cfg.Fingerprint, clock.Now)
	kv := cfg.KV
	if kv.Logger == nil {
		kv.Logger = parts
	}
	var err error
	if r.kv, err = kvmove.New(kv, kvRing{r}, local, r.hop, &http.Client{Transport: kvTransport}, clock.Now); err != nil {
		return nil, err
	}
	st := cfg.Stored
	st.Replicas = cfg.KV.Replicas // records are kept where the KV's replicas go
	if st.Logger == nil {
		st.Logger = parts
	}
	if r.stored, err = stored.New(st, storedRing{r}, r.hop, r.client, clock.Now); err != nil {
		return nil, err
	}
	r.quota = quota.New(nil, quotaRing{r}, r.hop, r.client, clock.Now, parts)
	r.scale = newAutoscaler(cfg.Scale)
	if len(cfg.Secret) == 0 {
		r.log.Warn("hops are not authenticated (insecure): anyone who reaches this node's HTTP port can submit raw requests as a peer")
	}
	return r, nil
}

// Collectors are the router's Prometheus metrics.
func (r *Router) Collectors() []prometheus.Collector {
	cs := []prometheus.Collector{r.forwards, r.prefills, r.prefixes, r.resumes, r.ringSize, r.degradedN}
	for _, more := range [][]prometheus.Collector{r.kv.Collectors(), r.stored.Collectors(), r.quota.Collectors(), r.scale.collectors(), r.answers.Collectors()} {
		cs = append(cs, more...)
	}
	return cs
}

// KeepAlive is how often this node, as an owner, tells an entry node that a forwarded
// request without a token yet is still in hand.
func (r *Router) KeepAlive() time.Duration { return r.cfg.KeepAlive }

// Ready reports whether this node may be on rings: model ready and gossip joined.
func (r *Router) Ready() (bool, string) {
	switch {
	case !r.local.Ready():
		return false, "model loading or engine stopped"
	case !r.v.gossip.Joined():
		return false, "gossip has not joined the cluster yet"
	case r.v.settling():
		return false, "peers are not on this node's ring yet"
	}
	r.v.settled.Store(true)
	return true, ""
}

// syncDelay is how long the first of a burst of membership changes (a join storm, a
// partition healing) waits for the rest, so the burst is one ring update.
const syncDelay = 50 * time.Millisecond

// Run follows membership, checks peers and gossips this node's state until ctx ends.
func (r *Router) Run(ctx context.Context) error {
	go r.followRing(ctx)
	go r.shareDigests(ctx)
	probe := time.NewTicker(r.cfg.ProbeInterval)
	defer probe.Stop()
	autoscale := time.NewTicker(scaleEvery)
	defer autoscale.Stop()
	var burst <-chan time.Time // set while a burst of membership changes gathers
	for {
		r.Publish()
		select {
		case <-ctx.Done():
			return nil
		case <-r.v.gossip.Changes():
			if burst == nil {
				burst = time.After(syncDelay)
			}
		case <-burst:
			burst = nil
			r.v.Sync()
		case <-autoscale.C:
			r.autoscale(ctx)
		case <-probe.C:
			r.v.Sync()
			r.v.ProbeAll(ctx)
			r.scale.observe(r.load())
		}
	}
}

// Publish gossips this node's readiness and load, and puts it on its own ring when ready.
func (r *Router) Publish() {
	ready, _ := r.Ready()
	st := r.local.Stats()
	tags, err := (Meta{
		ID: r.cfg.Self, HTTPAddr: r.cfg.HTTPAddr, Fingerprint: r.cfg.Fingerprint, Model: r.cfg.Model, Ready: ready, Hop: hop.Versions, HopMinor: hop.Minor,
		Running: st.Running, Waiting: st.Waiting, FreeKV: st.KVCells - st.KVUsed, KVActive: st.KVActive, KVCells: st.KVCells, QueueCap: r.cfg.QueueCap, Slots: st.Sequences,
		Prefill: int(st.PrefillRate), Decode: int(r.v.rate.update(r.clock.Now(), st.Generated)), Slow: r.v.speed.slow(),
		Role: map[string]string{RolePrefill: RolePrefill, RoleDecode: RoleDecode}[r.cfg.Role],
	}).Encode()
	if err == nil {
		err = r.v.gossip.SetTags(tags)
	}
	if err != nil {
		r.log.Error("cannot gossip metadata", "err", err)
	}
	if r.v.table.SetSelfReady(ready && r.cfg.Role != RolePrefill) { // a prefill node owns no conversation
		r.v.commit()
	}
}

// ModelInfo is one model the cluster serves, as this node sees it.
type ModelInfo struct {
	ID    string
	Nodes int  // live nodes that serve it (this one included, for its own)
	Ready int  // those on its ring here: ready, and healthy by this node's checks
	Local bool // this node serves it
}

// View is the cluster as this node sees it (GET /v1/cluster).
type View struct {
	Self    string       `json:"self"`
	Members []MemberView `json:"members"`
	// Ring is this node's ring drawn coarsely: the owner at each of a number of points
	// evenly spaced around it (View's argument; none by default).
	Ring []string `json:"ring,omitempty"`
	// Autoscale is the autoscaling controller's last run here: its inputs and output.
	Autoscale AutoscaleView `json:"autoscale"`
}

// AutoscaleView is the controller's inputs (the ring's nodes and the requests waiting on
// them) and output (the relative change it asks for, and the node count it wants).
type AutoscaleView struct {
	Nodes   int     `json:"nodes"`
	Waiting float64 `json:"waiting"` // the mean over the controller's period
	KVUsed  float64 `json:"kv_used"` // the share of the ring's KV cells held by running requests
	Desired int     `json:"desired"`
	Error   float64 `json:"error"`
	Output  float64 `json:"output"`
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
	Role        string         `json:"role"`                   // both, decode or prefill
	Fingerprint string         `json:"fingerprint"`            // model and KV-layout fingerprint
	Hop         []int          `json:"hop"`                    // hop protocol major versions spoken
	OnRing      bool           `json:"on_ring"`                // on its model's ring, here
	RingShare   float64        `json:"ring_share"`             // of its model's ring
	Load        map[string]int `json:"load"`
	TokensPerS  int            `json:"tokens_per_second"` // generated lately
	// Degraded: most of the cluster finds it slow (a gray failure; see the gray package). SlowHere:
	// this node does. ProbeMS: the moving average of this node's probes of it.
	Degraded bool    `json:"degraded"`
	SlowHere bool    `json:"slow_here,omitempty"`
	ProbeMS  float64 `json:"probe_ms,omitempty"`
	// PrefixDigest is how full its digest of the prompt beginnings it holds is, as
	// gossiped: the share of its bits set (see prefix.go); 0 when it holds none.
	PrefixDigest float64 `json:"prefix_digest,omitempty"`
}

// Hop is this node's end of the hop's authentication: node verifies with it what peers send.
func (r *Router) Hop() *hop.Auth { return r.hop }

// Peer reports whether ip is the gossip or API address of a member this node knows.
func (r *Router) Peer(ip netip.Addr) bool { return r.v.peer(ip) }

// View is the cluster as this node sees it (GET /v1/cluster), with its ring sampled at
// points places (0: not drawn).
func (r *Router) View(points int) View {
	ready, _ := r.Ready()
	v := r.v.View(points, ready)
	if d := r.held.Load(); d != nil {
		v.Members[0].PrefixDigest = d.fill()
	}
	r.scale.mu.Lock()
	v.Autoscale = r.scale.last
	r.scale.mu.Unlock()
	return v
}

// Models lists the models the cluster serves, this node's first, then by id.
func (r *Router) Models() []ModelInfo { return r.v.Models() }

// Serves reports whether a live peer serves model, by the id clients name it with.
func (r *Router) Serves(model string) bool { return r.v.Serves(model) }

package node

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/infernode/infernode/gossip"
	"github.com/infernode/infernode/ring"
)

// ClusterConfig configures a node's part in the cluster.
type ClusterConfig struct {
	// Self is this node's id (the same as Config.ID). Required.
	Self string
	// HTTPAddr is the host:port peers use to reach this node's API. Required.
	HTTPAddr string
	// Fingerprint identifies the model and KV layout; only peers with the same one share
	// a ring. Required.
	Fingerprint string
	// ProbeInterval is how often every peer's /readyz is checked. Default 500ms.
	ProbeInterval time.Duration
	// ProbeTimeout bounds one check. Default 300ms.
	ProbeTimeout time.Duration
	// ConnectTimeout bounds dialing a peer to forward a request. Default 1s.
	ConnectTimeout time.Duration
	// HeaderTimeout bounds waiting for a forwarded request's response headers (the
	// owner answers once the request is admitted and has produced its first token).
	// Default 60s.
	HeaderTimeout time.Duration
	// Candidates is how many ring owners a request may try before serving locally.
	// Default 3.
	Candidates int
	// APIKey is sent to peers that require one, when there is no Secret.
	APIKey string
	// Secret, if set, authenticates forwarded requests (HMAC-SHA256 of the body), so
	// outside clients cannot forge the hop marker. Every node needs the same secret.
	Secret string
	// DefaultMaxTokens is the engine's default token limit, for resuming requests that
	// named none.
	DefaultMaxTokens int
	// QueueCap is the engine's queue size, gossiped so peers spill over when it is full.
	QueueCap int
	Ring     ring.Config
	Logger   *slog.Logger
}

// DefaultClusterConfig returns infernode's cluster settings.
func DefaultClusterConfig() ClusterConfig {
	return ClusterConfig{
		ProbeInterval:  500 * time.Millisecond, // 3 failures: a dead peer is off the ring in ~1.5s
		ProbeTimeout:   300 * time.Millisecond,
		ConnectTimeout: time.Second,
		HeaderTimeout:  60 * time.Second,
		Candidates:     3,
		Ring:           ring.DefaultConfig(),
	}
}

// Cluster keeps this node's view of its peers (gossip membership, its own health checks,
// the ring) and routes requests to the owner of their conversation.
type Cluster struct {
	cfg    ClusterConfig
	log    *slog.Logger
	gossip *gossip.Gossip
	local  Engine
	client *http.Client

	mu      sync.Mutex
	table   *ring.Table
	members map[string]gossip.Member // by stable id: the live incarnation, else the newest
	down    map[string]chan struct{} // closed when the peer leaves this node's ring

	forwards *prometheus.CounterVec
	resumes  prometheus.Counter
	ringSize prometheus.GaugeFunc
}

// NewCluster builds the cluster view. It starts nothing: Run does.
func NewCluster(cfg ClusterConfig, g *gossip.Gossip, local Engine) (*Cluster, error) {
	if cfg.Self == "" || cfg.Fingerprint == "" || cfg.HTTPAddr == "" {
		return nil, errors.New("cluster: self id, HTTP address and fingerprint are required")
	}
	if err := cfg.Ring.Validate(); err != nil {
		return nil, fmt.Errorf("cluster: %w", err)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	c := &Cluster{
		cfg: cfg, log: log.With("component", "cluster", "node", cfg.Self), gossip: g, local: local,
		client: &http.Client{Transport: &http.Transport{
			DialContext:           (&net.Dialer{Timeout: cfg.ConnectTimeout, KeepAlive: 30 * time.Second}).DialContext,
			MaxIdleConnsPerHost:   64,
			IdleConnTimeout:       90 * time.Second,
			ResponseHeaderTimeout: cfg.HeaderTimeout,
		}},
		table:   ring.NewTable(cfg.Ring, cfg.Self),
		members: map[string]gossip.Member{},
		down:    map[string]chan struct{}{},
		forwards: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "infernode_forwards_total", Help: "Requests forwarded to their owner, by outcome.",
		}, []string{"outcome"}),
		resumes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "infernode_resumes_total", Help: "Streams resumed on another owner after theirs died mid-answer.",
		}),
	}
	c.ringSize = prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "infernode_ring_members", Help: "Peers on this node's ring, itself included.",
	}, func() float64 {
		c.mu.Lock()
		defer c.mu.Unlock()
		return float64(len(c.table.Ring().Members()))
	})
	return c, nil
}

func (c *Cluster) collectors() []prometheus.Collector {
	return []prometheus.Collector{c.forwards, c.resumes, c.ringSize}
}

// Ready reports whether this node may be on rings: model ready and gossip joined.
func (c *Cluster) Ready() (bool, string) {
	switch {
	case !c.local.Ready():
		return false, "model loading or engine stopped"
	case !c.gossip.Joined():
		return false, "gossip has not joined the cluster yet"
	}
	return true, ""
}

// Run follows membership, checks peers and gossips this node's state until ctx ends.
func (c *Cluster) Run(ctx context.Context) error {
	probe := time.NewTicker(c.cfg.ProbeInterval)
	defer probe.Stop()
	for {
		c.publish()
		select {
		case <-ctx.Done():
			return nil
		case <-c.gossip.Changes():
			c.sync()
		case <-probe.C:
			c.sync()
			c.probeAll(ctx)
		}
	}
}

// publish gossips this node's readiness and load, and puts it on its own ring when ready.
func (c *Cluster) publish() {
	ready, _ := c.Ready()
	st := c.local.Stats()
	err := c.gossip.SetMeta(gossip.Meta{
		ID: c.cfg.Self, HTTPAddr: c.cfg.HTTPAddr, Fingerprint: c.cfg.Fingerprint, Ready: ready,
		Running: st.Running, Waiting: st.Waiting, FreeKV: st.KVCells - st.KVUsed, QueueCap: c.cfg.QueueCap,
	})
	if err != nil {
		c.log.Error("cannot gossip metadata", "err", err)
	}
	c.mu.Lock()
	if c.table.SetSelfReady(ready) {
		c.logRing()
	}
	c.mu.Unlock()
}

// sync folds gossip's member list into the table.
func (c *Cluster) sync() {
	byID := map[string]gossip.Member{}
	for _, m := range c.gossip.Members() {
		id := m.Meta.ID
		if id == "" || id == c.cfg.Self {
			continue
		}
		if prev, seen := byID[id]; !seen || newer(m, prev) {
			byID[id] = m
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	changed := false
	for id, m := range byID {
		if m.State != gossip.Alive || m.Meta.Leaving {
			changed = c.table.Forget(id) || changed
		} else {
			changed = c.table.SetFacts(id, ring.Facts{Alive: true, Ready: m.Meta.Ready, Compatible: m.Meta.Fingerprint == c.cfg.Fingerprint}) || changed
		}
	}
	c.members = byID
	if changed {
		c.logRing()
	}
}

// newer reports whether incarnation a of a node should stand for it rather than b: a
// live one over a dead one, else the later start (incarnations sort by start time).
func newer(a, b gossip.Member) bool {
	if (a.State == gossip.Alive) != (b.State == gossip.Alive) {
		return a.State == gossip.Alive
	}
	return a.Name > b.Name
}

// logRing logs a new ring and cancels forwards to peers no longer on it; callers hold mu.
func (c *Cluster) logRing() {
	members := c.table.Ring().Members()
	c.log.Info("ring changed", "members", members)
	for id, ch := range c.down {
		if !slices.Contains(members, id) {
			close(ch)
			delete(c.down, id)
		}
	}
}

// downSignal is closed when peer leaves this node's ring (it is already closed if the peer
// is not on it now): forwards to a peer that has been declared down give up at once
// instead of waiting on a node that may never answer (a paused process keeps accepting
// connections).
func (c *Cluster) downSignal(peer string) <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	ch, ok := c.down[peer]
	if !ok {
		ch = make(chan struct{})
		if slices.Contains(c.table.Ring().Members(), peer) {
			c.down[peer] = ch
		} else {
			close(ch)
		}
	}
	return ch
}

// probeAll checks every alive peer's /readyz at once.
func (c *Cluster) probeAll(ctx context.Context) {
	c.mu.Lock()
	targets := map[string]string{}
	for id, m := range c.members {
		if m.State == gossip.Alive && !m.Meta.Leaving {
			targets[id] = m.Meta.HTTPAddr
		}
	}
	c.mu.Unlock()
	var wg sync.WaitGroup
	type result struct {
		peer string
		ok   bool
	}
	results := make(chan result, len(targets))
	for id, addr := range targets {
		wg.Go(func() { results <- result{id, c.probe(ctx, addr)} })
	}
	wg.Wait()
	close(results)
	c.mu.Lock()
	defer c.mu.Unlock()
	for r := range results {
		if c.table.Observe(r.peer, r.ok) {
			c.log.Info("peer health changed", "peer", r.peer, "healthy", r.ok)
			c.logRing()
		}
	}
}

func (c *Cluster) probe(ctx context.Context, addr string) bool {
	ctx, cancel := context.WithTimeout(ctx, c.cfg.ProbeTimeout)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "GET", "http://"+addr+"/readyz", nil)
	resp, err := c.client.Do(req)
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// observe records a forward's outcome as a health check of peer.
func (c *Cluster) observe(peer string, ok bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.table.Observe(peer, ok) {
		c.log.Info("peer health changed", "peer", peer, "healthy", ok, "by", "forward")
		c.logRing()
	}
}

// candidates are the peers to try for key, owner first.
func (c *Cluster) candidates(key string) []candidate {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []candidate
	for _, id := range c.table.Ring().Owners(key, c.cfg.Candidates) {
		m := c.members[id]
		out = append(out, candidate{id: id, addr: m.Meta.HTTPAddr, full: m.Meta.Full()})
	}
	return out
}

type candidate struct {
	id, addr string
	full     bool
}

// sign authenticates a forwarded body.
func (c *Cluster) sign(body []byte) string {
	if c.cfg.Secret == "" {
		return ""
	}
	return hex.EncodeToString(c.mac(body))
}

// verify checks a forwarded request's signature (always true without a secret).
func (c *Cluster) verify(body []byte, sig string) bool {
	if c.cfg.Secret == "" {
		return true
	}
	want, err := hex.DecodeString(sig)
	return err == nil && hmac.Equal(c.mac(body), want)
}

// mac is the HMAC-SHA256 of body with the cluster secret.
func (c *Cluster) mac(body []byte) []byte {
	m := hmac.New(sha256.New, []byte(c.cfg.Secret))
	m.Write(body)
	return m.Sum(nil)
}

// View is the cluster as this node sees it (GET /v1/cluster).
type View struct {
	Self    string       `json:"self"`
	Members []MemberView `json:"members"`
}

// MemberView is one member in View.
type MemberView struct {
	ID         string         `json:"id"`
	HTTPAddr   string         `json:"http_addr"`
	GossipAddr string         `json:"gossip_addr"`
	State      string         `json:"state"` // alive, suspect (alive in gossip, failing checks), dead, left
	Healthy    bool           `json:"healthy"`
	Ready      bool           `json:"ready"`
	Compatible bool           `json:"compatible"`
	OnRing     bool           `json:"on_ring"`
	RingShare  float64        `json:"ring_share"`
	Load       map[string]int `json:"load"`
}

// View returns the cluster as this node sees it.
func (c *Cluster) View() View {
	c.mu.Lock()
	defer c.mu.Unlock()
	shares := c.table.Ring().Shares()
	v := View{Self: c.cfg.Self}
	ready, _ := c.Ready()
	st := c.local.Stats()
	selfAddr := c.gossip.Addr()
	v.Members = append(v.Members, MemberView{
		ID: c.cfg.Self, HTTPAddr: c.cfg.HTTPAddr, GossipAddr: selfAddr, State: "alive", Healthy: true, Ready: ready,
		Compatible: true, OnRing: shares[c.cfg.Self] > 0, RingShare: shares[c.cfg.Self],
		Load: map[string]int{"running": st.Running, "waiting": st.Waiting, "free_kv": st.KVCells - st.KVUsed},
	})
	peers := map[string]ring.Peer{}
	for _, p := range c.table.Peers() {
		peers[p.ID] = p
	}
	for id, m := range c.members {
		p := peers[id]
		state := string(m.State)
		if m.State == gossip.Alive && !p.Healthy {
			state = "suspect"
		}
		if m.Meta.Leaving {
			state = "left"
		}
		v.Members = append(v.Members, MemberView{
			ID: id, HTTPAddr: m.Meta.HTTPAddr, GossipAddr: m.Addr, State: state, Healthy: p.Healthy, Ready: m.Meta.Ready,
			Compatible: m.Meta.Fingerprint == c.cfg.Fingerprint, OnRing: p.OnRing, RingShare: shares[id],
			Load: map[string]int{"running": m.Meta.Running, "waiting": m.Meta.Waiting, "free_kv": m.Meta.FreeKV},
		})
	}
	sort.Slice(v.Members[1:], func(i, j int) bool { return strings.Compare(v.Members[1+i].ID, v.Members[1+j].ID) < 0 })
	return v
}

package gossip

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/memberlist"
)

// Config configures membership.
type Config struct {
	// ID is the node's stable id. Required.
	ID string
	// Incarnation tells this process start apart from earlier ones of the same ID; the
	// memberlist name is ID#Incarnation, so a restarted node is a new member and never
	// waits out the old one's dead timeout. Default: the start time in nanoseconds.
	Incarnation string
	// BindAddr and BindPort are where gossip listens (TCP and UDP). Port 0 picks one.
	BindAddr string
	BindPort int
	// AdvertiseAddr and AdvertisePort are what peers dial; default: the bound address
	// (an explicit address is needed when binding 0.0.0.0).
	AdvertiseAddr string
	AdvertisePort int
	// Join lists seed peers (host:port). A host name stands for every address it
	// resolves to, looked up again at each join: a Kubernetes headless service's name is
	// every pod of its StatefulSet. Empty starts a new cluster, and so does a list that
	// resolves to this node alone (the first pod of a service).
	Join []string
	// LookupHost resolves a seed's host name to addresses. Nil means the system resolver.
	LookupHost func(ctx context.Context, host string) ([]string, error)
	// RejoinInterval is how often a node that sees members dead, or sees none, joins
	// again (a seed, and dead members' addresses), so a node or a side of a partition cut
	// off longer than the dead timeout finds its way back; and how often a few nodes look
	// for a departed member at its address until it is forgotten, so a node restarted
	// where it was with no seeds of its own (the first node of a cluster, in a rolling
	// upgrade) does not serve alone until memberlist's anti-entropy reaches it. A node
	// that sees every member alive does not: at 1,000 members, rejoining every interval
	// cost each seed 200 full-state exchanges a second (docs/SCALE.md). Default 5s.
	RejoinInterval time.Duration
	// MetaInterval bounds how often metadata changes are gossiped. Default 500ms.
	MetaInterval time.Duration
	// LoadUpdates bounds the updates a second the whole cluster gossips for changes of
	// load alone (requests running and waiting, free KV, prefill rate): each member sends
	// one at most every max(MetaInterval, members/LoadUpdates), so their cost stays flat
	// as the cluster grows. Other changes (readiness, a full queue, leaving) go out
	// within MetaInterval at any size. Default 100: every 500ms up to 50 members, every
	// 10s at 1,000.
	LoadUpdates float64
	// NoteUpdates bounds the notes a second the whole cluster gossips (see SetNote):
	// each member sends one at most every max(MetaInterval, members/NoteUpdates).
	// Default 10.
	NoteUpdates float64
	// Key, if set (16, 24 or 32 bytes), encrypts gossip; every node needs the same key.
	Key []byte
	// ExtraKeys are further keys that decrypt (never encrypt) gossip, for rotating Key
	// without downtime: install the new key as extra everywhere, make it the Key, then
	// remove the old one.
	ExtraKeys [][]byte
	// ProbeInterval, ProbeTimeout and SuspicionMult tune failure detection; defaults are
	// set for a LAN: a dead node is declared dead in about 2 seconds.
	ProbeInterval time.Duration
	ProbeTimeout  time.Duration
	SuspicionMult int
	// GossipInterval and GossipNodes: every GossipInterval, queued news goes to
	// GossipNodes random members. PushPullInterval is how often a member swaps its whole
	// state with one other, which repairs any news lost on the way (memberlist stretches
	// it with the cluster's size).
	GossipInterval   time.Duration
	GossipNodes      int
	PushPullInterval time.Duration
	// ForgetAfter is how long a dead or departed member stays in Members before it is
	// pruned (so the list does not grow with every process that ever joined). Default 1m.
	ForgetAfter time.Duration
	// Logger receives membership logs. Nil means slog.Default().
	Logger *slog.Logger
	// Transport carries gossip; nil means memberlist's UDP and TCP on BindAddr:BindPort.
	// Simulations run whole clusters in one process over an in-memory one
	// (internal/simnet).
	Transport memberlist.NodeAwareTransport
	// DisableCompression turns off memberlist's compression of every message (LZW),
	// which costs far more CPU than the rest of gossip: simulations of a thousand members
	// on two cores turn it off. A real node keeps it (its default).
	DisableCompression bool
	// Observe, if set, is called with every membership event as it is recorded, from
	// memberlist's goroutines: it must not block.
	Observe func(Member)
	// Schema is the application's format of the tags gossip carries for it. Required.
	Schema Schema
	// Protocol is the application's protocol versions this node speaks (serf's delegate
	// versions: min, max, current), carried beside the tags for peers to read
	// (Member.Protocol). memberlist admits a member only while every member's current
	// version lies within every other's [min, max]: raising them is a rolling change of its
	// own. Default zero: none said (what every node of this version says).
	Protocol [3]uint8
	// Rand orders seeds and dead members to re-join. Nil: a source seeded from the clock.
	Rand *rand.Rand
}

// Schema is what gossip asks of the application about the tags it carries, opaque to it:
// routing's Meta implements it.
type Schema interface {
	// Validate checks a member's tags, received from the network, before they can steer
	// traffic; name is the member's gossip name (id#incarnation).
	Validate(name string, tags []byte) error
	// Leaving reports whether a member's tags say it is leaving: memberlist's leave
	// callback does not tell a leave from a death.
	Leaving(tags []byte) bool
	// Leave is this node's tags as it announces its leave.
	Leave(tags []byte) []byte
	// Urgent reports whether a change of this node's tags from sent to next must go out
	// within MetaInterval at any size, rather than at the pace LoadUpdates allows.
	Urgent(sent, next []byte) bool
}

// MaxTags is the most bytes of tags a node may carry: memberlist's metadata limit.
const MaxTags = memberlist.MetaMaxSize

// DefaultConfig returns gossip settings for a LAN.
func DefaultConfig() Config {
	return Config{
		BindAddr:         "0.0.0.0",
		BindPort:         7946,
		RejoinInterval:   5 * time.Second,
		MetaInterval:     500 * time.Millisecond,
		LoadUpdates:      100,                    // docs/SCALE.md: ~42 KiB/s a member (uncompressed) at 100 and at 300 members
		NoteUpdates:      10,                     // notes.go: at 1,000 members a member's digest of prefixes goes out every 100s at most
		ProbeInterval:    500 * time.Millisecond, // memberlist's LAN default is 1s
		ProbeTimeout:     250 * time.Millisecond, // loopback and LAN round trips are far below this
		SuspicionMult:    3,                      // suspect → dead after 3*log10(n)*probe, at least 1.5s
		GossipInterval:   100 * time.Millisecond, // memberlist's LAN default is 200ms: news spreads twice as fast
		GossipNodes:      3,                      // memberlist's LAN default
		PushPullInterval: 10 * time.Second,       // anti-entropy: an update a starved node missed is repaired within 10s (memberlist stretches it: x6 at 1,000)
		ForgetAfter:      time.Minute,            // long past any view that still routes to it
	}
}

// WANConfig returns gossip settings for members spread over a WAN (round trips up to a
// few hundred milliseconds, some loss): memberlist's WAN defaults, which docs/SCALE.md
// checks by simulation. A dead member is known dead to all in about 75 seconds at 100
// members instead of 4.5 (the ring drops a peer that stops answering HTTP sooner: see
// routing.WANConfig).
func WANConfig() Config {
	c := DefaultConfig()
	c.ProbeInterval = 5 * time.Second         // memberlist's WAN default: probes are rarer, so slower links are not flooded
	c.ProbeTimeout = 3 * time.Second          // above any WAN round trip, with room for a congested queue
	c.SuspicionMult = 6                       // a suspect has longer to refute before it is declared dead
	c.GossipInterval = 500 * time.Millisecond // memberlist's WAN default
	c.GossipNodes = 4                         // fewer rounds, one more member each
	c.PushPullInterval = 60 * time.Second     // full syncs cost more over a WAN
	c.MetaInterval = 2 * time.Second          // load news is older anyway by the time it arrives
	return c
}

// Validate reports every problem with c at once.
func (c Config) Validate() error {
	var errs []error
	if c.ID == "" {
		errs = append(errs, errors.New("gossip: node id is required"))
	}
	if c.Schema == nil {
		errs = append(errs, errors.New("gossip: the schema of the tags is required"))
	}
	for _, k := range append([][]byte{c.Key}, c.ExtraKeys...) {
		if n := len(k); n != 0 && n != 16 && n != 24 && n != 32 {
			errs = append(errs, fmt.Errorf("gossip: keys must be 16, 24 or 32 bytes, got %d", n))
		}
	}
	if len(c.ExtraKeys) > 0 && len(c.Key) == 0 {
		errs = append(errs, errors.New("gossip: extra keys need a primary key"))
	}
	if c.GossipInterval <= 0 || c.GossipNodes < 1 || c.PushPullInterval <= 0 {
		errs = append(errs, fmt.Errorf("gossip: gossip interval (%v), gossip nodes (%d) and push-pull interval (%v) must be positive",
			c.GossipInterval, c.GossipNodes, c.PushPullInterval))
	}
	if c.ProbeInterval <= 0 || c.ProbeTimeout <= 0 || c.ProbeTimeout >= c.ProbeInterval {
		errs = append(errs, fmt.Errorf("gossip: need 0 < probe timeout (%v) < probe interval (%v)", c.ProbeTimeout, c.ProbeInterval))
	}
	if c.SuspicionMult < 1 || c.RejoinInterval <= 0 || c.MetaInterval <= 0 || c.ForgetAfter <= 0 || c.LoadUpdates <= 0 || c.NoteUpdates <= 0 {
		errs = append(errs, fmt.Errorf("gossip: suspicion multiplier (%d), rejoin interval (%v), meta interval (%v), forget-after (%v), load updates (%v) and note updates (%v) must be positive",
			c.SuspicionMult, c.RejoinInterval, c.MetaInterval, c.ForgetAfter, c.LoadUpdates, c.NoteUpdates))
	}
	return errors.Join(errs...)
}

// State is a member's state as gossip sees it.
type State string

const (
	Alive State = "alive"
	Dead  State = "dead" // stopped answering probes
	Left  State = "left" // left gracefully
)

// Member is one member of the cluster.
type Member struct {
	Name  string // memberlist name: id#incarnation
	Addr  string // gossip host:port
	Tags  []byte // the application's, opaque here (see Schema)
	State State
	// Protocol is the member's application protocol versions: min, max, current (see
	// Config.Protocol).
	Protocol [3]uint8
	// Invalid says why the member's tags were refused by Schema.Validate (empty when they
	// are valid). Such a member is listed, so operators can see it, but must never receive
	// traffic.
	Invalid string
	since   time.Time // when State last changed
}

// Gossip is a node's membership.
type Gossip struct {
	cfg  Config
	log  *slog.Logger
	name string

	rng *rand.Rand // Run's goroutine only

	mu      sync.Mutex
	tags    []byte
	sent    []byte // tags as last gossiped; guarded by mu
	members map[string]Member
	addr    string // advertised gossip address, set once Run has started memberlist
	joined  bool

	// Notes (see notes.go), guarded by mu but queue, which has its own lock.
	note        []byte           // this node's, as last set
	notes       map[string]*note // by member name, this node's as last sent included
	noteSent    time.Time
	noteVersion uint64
	queue       *memberlist.TransmitLimitedQueue
	size        atomic.Int64 // members memberlist counts, for queue

	changes chan struct{}
}

// New validates cfg and this node's first tags. It starts nothing: Run does.
func New(cfg Config, tags []byte) (*Gossip, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if err := checkTags(tags); err != nil {
		return nil, err
	}
	if cfg.Incarnation == "" {
		cfg.Incarnation = strconv.FormatInt(time.Now().UnixNano(), 36)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	rng := cfg.Rand
	if rng == nil {
		seed := uint64(time.Now().UnixNano())
		rng = rand.New(rand.NewPCG(seed, seed>>32|1))
	}
	g := &Gossip{
		cfg: cfg, log: log.With("component", "gossip"), name: cfg.ID + "#" + cfg.Incarnation, rng: rng,
		tags: tags, sent: tags, members: map[string]Member{}, changes: make(chan struct{}, 1),
		notes: map[string]*note{}, noteVersion: uint64(time.Now().UnixNano()),
	}
	g.queue = &memberlist.TransmitLimitedQueue{NumNodes: func() int { return int(g.size.Load()) }, RetransmitMult: retransmitMult}
	return g, nil
}

// retransmitMult is memberlist's RetransmitMult, which the notes' queue uses too.
const retransmitMult = 4

func checkTags(tags []byte) error {
	if len(tags) > MaxTags {
		return fmt.Errorf("gossip metadata is %d bytes, over memberlist's %d (shorten the id or address)", len(tags), MaxTags)
	}
	return nil
}

// Name is this node's memberlist name.
func (g *Gossip) Name() string { return g.name }

// Changes signals (coalesced) that Members may have changed.
func (g *Gossip) Changes() <-chan struct{} { return g.changes }

// Members is a snapshot of every member ever seen, with its latest state, this node
// included.
func (g *Gossip) Members() []Member {
	g.mu.Lock()
	defer g.mu.Unlock()
	out := make([]Member, 0, len(g.members))
	for _, m := range g.members {
		out = append(out, m)
	}
	slices.SortFunc(out, func(a, b Member) int { return strings.Compare(a.Name, b.Name) })
	return out
}

// Joined reports whether this node has joined a cluster (or started one: no seeds).
func (g *Gossip) Joined() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.joined
}

// Addr is the gossip address peers use, once Run has started.
func (g *Gossip) Addr() string {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.addr
}

// SetTags replaces this node's tags; Run gossips them within MetaInterval, or for a
// change that is not urgent (Schema.Urgent) as LoadUpdates allows.
func (g *Gossip) SetTags(tags []byte) error {
	if err := checkTags(tags); err != nil {
		return err
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	g.tags = slices.Clone(tags)
	return nil
}

// Run starts memberlist, joins the seeds (retrying with backoff), re-joins them
// periodically, gossips metadata changes, and on ctx's end leaves the cluster gracefully.
func (g *Gossip) Run(ctx context.Context) error {
	mc := memberlist.DefaultLANConfig()
	mc.Name = g.name
	mc.BindAddr, mc.BindPort = g.cfg.BindAddr, g.cfg.BindPort
	mc.AdvertiseAddr, mc.AdvertisePort = g.cfg.AdvertiseAddr, g.cfg.AdvertisePort
	mc.ProbeInterval, mc.ProbeTimeout, mc.SuspicionMult = g.cfg.ProbeInterval, g.cfg.ProbeTimeout, g.cfg.SuspicionMult
	mc.GossipInterval, mc.GossipNodes, mc.PushPullInterval = g.cfg.GossipInterval, g.cfg.GossipNodes, g.cfg.PushPullInterval
	mc.RetransmitMult = retransmitMult
	if len(g.cfg.Key) > 0 {
		kr, err := memberlist.NewKeyring(g.cfg.ExtraKeys, g.cfg.Key)
		if err != nil {
			return fmt.Errorf("gossip: keyring: %w", err)
		}
		mc.Keyring = kr
		mc.GossipVerifyIncoming, mc.GossipVerifyOutgoing = true, true
	}
	if g.cfg.Transport != nil {
		mc.Transport = g.cfg.Transport
	}
	mc.EnableCompression = !g.cfg.DisableCompression
	mc.DelegateProtocolMin, mc.DelegateProtocolMax, mc.DelegateProtocolVersion = g.cfg.Protocol[0], g.cfg.Protocol[1], g.cfg.Protocol[2]
	mc.Delegate = delegate{g}
	mc.Events = events{g}
	mc.Logger = slog.NewLogLogger(g.log.Handler(), slog.LevelDebug)
	ml, err := memberlist.Create(mc)
	if err != nil {
		return fmt.Errorf("gossip: start memberlist: %w", err)
	}
	// memberlist calls the event delegate (record, which takes mu) while holding its own
	// node lock, and mutates the node LocalNode returns: read the address once, here,
	// and never call into memberlist while holding mu.
	local := ml.LocalNode()
	addr := net.JoinHostPort(local.Addr.String(), strconv.Itoa(int(local.Port)))
	g.mu.Lock()
	g.addr = addr
	g.joined = len(g.cfg.Join) == 0
	g.mu.Unlock()
	g.log.Info("gossip started", "name", g.name, "addr", g.Addr(), "seeds", g.cfg.Join)

	defer func() {
		// Announce the leave in metadata first: memberlist's leave callback does not say
		// whether a node left or died.
		g.mu.Lock()
		g.tags = g.cfg.Schema.Leave(g.tags)
		g.mu.Unlock()
		if err := ml.UpdateNode(500 * time.Millisecond); err != nil {
			g.log.Debug("leave announcement failed", "err", err)
		}
		if err := ml.Leave(time.Second); err != nil {
			g.log.Warn("leave failed", "err", err)
		}
		ml.Shutdown()
		g.log.Info("gossip stopped")
	}()

	backoff := 100 * time.Millisecond
	joinAt := time.Now()
	tick := time.NewTicker(min(g.cfg.MetaInterval, 200*time.Millisecond))
	defer tick.Stop()
	lastMeta := time.Time{}
	for {
		now := time.Now()
		var targets []string
		if !now.Before(joinAt) {
			targets = g.joinTargets(ctx, ml.NumMembers())
			joinAt = now.Add(g.cfg.RejoinInterval) // unless a join below says otherwise
		}
		if len(targets) > 0 {
			n, err := ml.Join(targets)
			switch {
			case err != nil && n == 0:
				g.log.Debug("join failed", "addrs", targets, "err", err, "retry_in", backoff)
				joinAt, backoff = now.Add(backoff), min(2*backoff, g.cfg.RejoinInterval)
			default:
				if !g.Joined() {
					g.log.Info("joined cluster", "contacted", n)
				}
				g.mu.Lock()
				g.joined = true
				g.mu.Unlock()
				joinAt, backoff = now.Add(g.cfg.RejoinInterval), 100*time.Millisecond
			}
		}
		members := ml.NumMembers() // before mu: memberlist calls record, which takes mu, under its own lock
		g.size.Store(int64(members))
		g.sendNote(now, members)
		g.mu.Lock()
		push := g.due(now.Sub(lastMeta), members)
		if push {
			g.sent = g.tags
		}
		g.mu.Unlock()
		if push {
			lastMeta = now
			if err := ml.UpdateNode(time.Second); err != nil {
				g.log.Warn("metadata update not confirmed; sending it again", "err", err)
				g.mu.Lock()
				g.sent = nil // due again after MetaInterval
				g.mu.Unlock()
			}
		}
		g.prune(now)
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
	}
}

// joinFanout bounds the addresses one join contacts: memberlist exchanges its whole state
// with each, and a seed list may name every node (a headless service's DNS name does).
const joinFanout = 3

// seeds resolves the seed list (see Config.Join) to host:port addresses, this node's own
// left out. alone reports that every seed resolved and the only address was this node's.
func (g *Gossip) seeds(ctx context.Context) (addrs []string, alone bool) {
	lookup := g.cfg.LookupHost
	if lookup == nil {
		lookup = net.DefaultResolver.LookupHost
	}
	self := g.Addr()
	resolved, selfSeen := true, false
	for _, seed := range g.cfg.Join {
		host, port, err := net.SplitHostPort(seed)
		if err != nil {
			g.log.Warn("seed is not host:port", "seed", seed, "err", err)
			continue
		}
		hosts := []string{host}
		if net.ParseIP(host) == nil {
			lctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			hosts, err = lookup(lctx, host)
			cancel()
			if err != nil {
				g.log.Debug("cannot resolve seed", "seed", seed, "err", err)
				resolved = false
				continue
			}
		}
		for _, h := range hosts {
			switch addr := net.JoinHostPort(h, port); {
			case addr == self:
				selfSeen = true
			case !slices.Contains(addrs, addr):
				addrs = append(addrs, addr)
			}
		}
	}
	return addrs, resolved && selfSeen && len(addrs) == 0
}

// joinTargets are the addresses to join now, given the members memberlist counts: up to
// joinFanout seeds in random order until this node has joined; after that, only when it
// sees a member dead or none at all, one seed and up to two dead members' addresses
// (either may be on the far side of a healed partition), and otherwise, now and then, the
// address of a member that left (see RejoinInterval). The seeds are resolved only when a
// join is due (a DNS name may be slow to answer).
func (g *Gossip) joinTargets(ctx context.Context, members int) []string {
	g.mu.Lock()
	joined := g.joined
	var dead, left []string
	alive := map[string]bool{}
	for _, m := range g.members {
		if m.State == Alive {
			alive[m.Addr] = true
		}
	}
	for _, m := range g.members {
		switch {
		case alive[m.Addr]: // back already, under a new name
		case m.State == Dead:
			dead = append(dead, m.Addr)
		case m.State == Left && g.rng.Float64() < float64(joinFanout)/float64(max(members, 1)):
			// A departed member may come back where it was, with no seeds (the first
			// node of a cluster, restarted): a few nodes of the cluster look for it each
			// interval, not every one, so that its return costs it a few full-state
			// exchanges, and a seed none.
			left = append(left, m.Addr)
		}
	}
	g.mu.Unlock()
	if joined && len(dead) == 0 && members > 1 {
		return left[:min(joinFanout, len(left))] // the seeds are not even looked up
	}
	seeds, alone := g.seeds(ctx)
	if alone && !joined {
		g.log.Info("the seeds resolve to this node alone: starting the cluster", "seeds", g.cfg.Join)
		g.mu.Lock()
		g.joined = true
		g.mu.Unlock()
	}
	g.rng.Shuffle(len(seeds), func(i, j int) { seeds[i], seeds[j] = seeds[j], seeds[i] })
	if !joined {
		return seeds[:min(joinFanout, len(seeds))]
	}
	g.rng.Shuffle(len(dead), func(i, j int) { dead[i], dead[j] = dead[j], dead[i] })
	return append(seeds[:min(1, len(seeds))], dead[:min(joinFanout-1, len(dead))]...)
}

// due reports whether this node's tags should be gossiped now, since after last went
// out, in a cluster of members. Callers hold mu.
func (g *Gossip) due(since time.Duration, members int) bool {
	switch {
	case since < g.cfg.MetaInterval || bytes.Equal(g.tags, g.sent):
		return false
	case g.cfg.Schema.Urgent(g.sent, g.tags):
		return true
	}
	return since.Seconds() >= float64(members)/g.cfg.LoadUpdates
}

func (g *Gossip) signal() {
	select {
	case g.changes <- struct{}{}:
	default:
	}
}

// prune forgets members that have been dead or gone for ForgetAfter.
func (g *Gossip) prune(now time.Time) {
	g.mu.Lock()
	defer g.mu.Unlock()
	for name, m := range g.members {
		if m.State != Alive && now.Sub(m.since) >= g.cfg.ForgetAfter {
			delete(g.members, name)
			delete(g.notes, name)
		}
	}
}

// record stores what memberlist says about a node. Called from memberlist's goroutines:
// it must not block.
func (g *Gossip) record(n *memberlist.Node, st State) {
	err := g.cfg.Schema.Validate(n.Name, n.Meta)
	m := Member{Name: n.Name, Addr: net.JoinHostPort(n.Addr.String(), strconv.Itoa(int(n.Port))), Tags: slices.Clone(n.Meta),
		State: st, Protocol: [3]uint8{n.DMin, n.DMax, n.DCur}, since: time.Now()}
	if err != nil {
		m.Invalid = err.Error()
	}
	g.mu.Lock()
	prev, seen := g.members[n.Name]
	if seen && prev.State == st {
		m.since = prev.since
	}
	g.members[n.Name] = m
	g.mu.Unlock()
	if err != nil && (!seen || prev.Invalid != m.Invalid) {
		g.log.Warn("refused metadata from peer", "name", n.Name, "addr", m.Addr, "err", err)
	}
	g.log.Debug("member", "name", n.Name, "state", st)
	if g.cfg.Observe != nil {
		g.cfg.Observe(m)
	}
	g.signal()
}

// delegate serves this node's metadata. memberlist calls it from its own goroutines.
type delegate struct{ g *Gossip }

func (d delegate) NodeMeta(limit int) []byte {
	d.g.mu.Lock()
	defer d.g.mu.Unlock()
	if len(d.g.tags) > limit {
		return nil // SetTags refuses tags that do not fit; this cannot happen
	}
	return d.g.tags
}
func (d delegate) NotifyMsg(buf []byte) { d.g.receive(buf) }
func (d delegate) GetBroadcasts(overhead, limit int) [][]byte {
	return d.g.queue.GetBroadcasts(overhead, limit)
}
func (d delegate) LocalState(join bool) []byte            { return d.g.localState() }
func (d delegate) MergeRemoteState(buf []byte, join bool) { d.g.mergeState(buf) }

// events records membership changes. memberlist calls it synchronously; it must not block.
type events struct{ g *Gossip }

func (e events) NotifyJoin(n *memberlist.Node)   { e.g.record(n, Alive) }
func (e events) NotifyUpdate(n *memberlist.Node) { e.g.record(n, Alive) }
func (e events) NotifyLeave(n *memberlist.Node) {
	st := Dead
	if e.g.cfg.Schema.Leaving(n.Meta) {
		st = Left
	}
	e.g.record(n, st)
}

package kvmove

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/time/rate"

	"github.com/infernode/infernode/internal/keep"
	"github.com/infernode/infernode/node/hop"
	"github.com/infernode/infernode/session/infer"
)

// Peer is a node a frame can go to, or come from.
type Peer struct {
	ID, Addr string
	Minor    int // the hop minor version it gossips
}

// Ring is what kvmove needs to know of the cluster, as this node sees it. routing's view
// implements it. Its methods are safe for concurrent use and do not block.
type Ring interface {
	// Owner is key's owner on this node's ring, when that is another node.
	Owner(key string) (Peer, bool)
	// Heirs are up to n members that would own key in turn once this node has left or
	// failed: the owner on the ring without it, then the owner without that one too, and
	// so on.
	Heirs(key string, n int) []Peer
	// Prefill is the prompt tokens a second peer gossips it prefills (0: unknown).
	Prefill(peer string) float64
	// Joined is when this node's ring first held another member (zero: not yet).
	Joined() time.Time
	// Leavers are the members that left gracefully a short while ago: they drain and hand
	// their caches off, and answer pulls meanwhile.
	Leavers() []Peer
	// Happened records a cluster event (kind "handoff": a conversation moved).
	Happened(kind, peer, detail string)
}

// Local is what kvmove needs of this node's engine (session.Handle has it). Its methods
// are safe for concurrent use.
type Local interface {
	// Snapshot copies a cached conversation's KV out as a frame (infer.ErrNotCached: none
	// idle here).
	Snapshot(ctx context.Context, key string) (infer.Frame, error)
	// Import installs a frame, as a replica or as a conversation this node owns.
	Import(ctx context.Context, frame []byte, origin infer.Origin, want string) (infer.Imported, error)
	// Conversations lists the conversations cached, most recently used first.
	Conversations(ctx context.Context) ([]string, error)
	// Demote keeps a conversation that moved to its owner as a replica here.
	Demote(ctx context.Context, key string) error
	// Holds reports whether a conversation is cached here.
	Holds(key string) bool
	Stats() infer.Stats
}

// Why says why a conversation's KV is pushed, and so to whom.
type Why int

const (
	// ToOwner: the conversation's owner on this node's ring is another node now.
	ToOwner Why = iota
	// Leaving: this node is leaving; its owner once this node has left takes it.
	Leaving
	// Replica: copies for the Config.Replicas nodes that would take the conversation over
	// if this one failed. Best effort: skipped when transfers are busy.
	Replica
)

var (
	// ErrNoOwner: no other node is on the ring to take a conversation.
	ErrNoOwner = errors.New("no other owner on the ring")
	// ErrBusy: a replica was skipped because Config.Transfers pushes were running.
	ErrBusy = errors.New("KV transfers busy")
	// ErrRecompute: the destination would prefill the conversation's tokens sooner than
	// the transfer would bring them (see Config.Margin), so it was not sent.
	ErrRecompute = errors.New("recomputing the KV is cheaper than transferring it")
)

// Mover moves this node's conversations' KV to and from peers.
type Mover struct {
	cfg    Config
	log    *slog.Logger
	ring   Ring
	local  Local
	hop    *hop.Auth
	client *http.Client
	now    func() time.Time

	slots    chan struct{} // pushes in flight
	warming  chan struct{} // replicas being snapshotted and pushed in the background (KeepWarm)
	pullBufs *keep.Buffers // buffers of pulled frames, kept between pulls (the import copies the frame out)
	limit    *rate.Limiter // bytes a second of pushes (nil: no bound)

	mu     sync.Mutex
	rates  map[string]float64   // bytes a second of past pushes, by peer id (moving average)
	pulled map[string]time.Time // when each conversation was last asked for (see previousOwners)
	handed map[string]bool      // conversations pushed to their heirs on this node's leave
	away   map[string]string    // conversations served here though another node owned them: that owner (see Away)
	// replicas are the peers that took this node's last replica of each conversation (see
	// Replicas).
	replicas map[string][]string
	// perToken is the KV bytes a token of the last frame moved (see TransferTime).
	perToken float64

	transfers *prometheus.CounterVec
	imports   *prometheus.CounterVec // origin
	bytes     *prometheus.CounterVec
	seconds   *prometheus.CounterVec
}

// New builds a mover that signs with auth and sends with client.
func New(cfg Config, ring Ring, local Local, auth *hop.Auth, client *http.Client, now func() time.Time) (*Mover, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	m := &Mover{
		cfg: cfg, log: log.With("component", "kvmove"), ring: ring, local: local, hop: auth, client: client, now: now,
		slots:    make(chan struct{}, cfg.Transfers),
		warming:  make(chan struct{}, cfg.Transfers),
		pullBufs: keep.New(cfg.Transfers, maxPulled),
		limit:    newLimit(cfg.Bandwidth),
		rates:    map[string]float64{},
		pulled:   map[string]time.Time{},
		away:     map[string]string{},
		replicas: map[string][]string{},
		handed:   map[string]bool{},
		transfers: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "infernode_kv_transfers_total", Help: "Conversation KV caches pushed to (sent) or taken from (received) peers, by outcome.",
		}, []string{"direction", "outcome"}),
		imports: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "infernode_kv_imports_total", Help: "Conversations' KV installed here from peers, by how they came: replica, handoff (from a leaving owner), push (ownership moved), pull (asked on a miss).",
		}, []string{"origin"}),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "infernode_kv_transfer_bytes_total", Help: "Bytes of KV frames transferred successfully.",
		}, []string{"direction"}),
		seconds: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "infernode_kv_transfer_seconds_total", Help: "Time spent transferring KV frames successfully.",
		}, []string{"direction"}),
	}
	for _, o := range []infer.Origin{infer.Replica, infer.HandOff, infer.Pushed, infer.Pulled} {
		m.imports.WithLabelValues(string(o))
	}
	return m, nil
}

// Collectors are the mover's metrics.
func (m *Mover) Collectors() []prometheus.Collector {
	return []prometheus.Collector{m.transfers, m.imports, m.bytes, m.seconds}
}

// Observe records a transfer this node took part in (direction "sent", "received" or
// "pulled").
func (m *Mover) Observe(direction string, size int, took time.Duration, err error) {
	outcome := "ok"
	if err != nil {
		outcome = "refused"
	}
	m.transfers.WithLabelValues(direction, outcome).Inc()
	if err == nil {
		m.bytes.WithLabelValues(direction).Add(float64(size))
		m.seconds.WithLabelValues(direction).Add(took.Seconds())
	}
}

// Push exports a conversation and pushes it where why says, returning the peers it went
// to. infer.ErrNotCached: nothing idle to copy (a next turn already runs, or it was
// evicted).
func (m *Mover) Push(ctx context.Context, key string, why Why) ([]string, error) {
	frame, err := m.local.Snapshot(ctx, key)
	if err != nil {
		return nil, err
	}
	defer frame.Release()
	sent, err := m.PushFrame(ctx, key, frame, why)
	if why == Leaving {
		m.mu.Lock()
		if err == nil {
			m.handed[key] = true
		} else {
			delete(m.handed, key)
		}
		m.mu.Unlock()
	}
	return sent, err
}

// handedOff reports whether key's conversation, as cached here now, went to its heir on
// this node's leave.
func (m *Mover) handedOff(key string) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.handed[key]
}

// PushFrame sends a conversation's KV frame where why says and returns the peers it went
// to. At most Config.Transfers pushes run at once and together they keep within
// Config.Bandwidth, so transfers never take every connection, core or the link from
// serving. A peer that would recompute the tokens sooner than the transfer would take is
// skipped (ErrRecompute).
func (m *Mover) PushFrame(ctx context.Context, key string, frame infer.Frame, why Why) ([]string, error) {
	var to []Peer
	switch why {
	case ToOwner:
		if p, ok := m.ring.Owner(key); ok {
			to = []Peer{p}
		}
	case Leaving:
		to = m.ring.Heirs(key, 1)
	case Replica:
		to = m.ring.Heirs(key, m.cfg.Replicas)
	}
	if len(to) == 0 {
		return nil, ErrNoOwner
	}
	var sent []string
	var errs []error
	for _, p := range to {
		if err := m.pushTo(ctx, p, frame, why); err != nil {
			errs = append(errs, err)
			continue
		}
		sent = append(sent, p.ID)
	}
	if why == Replica && len(sent) > 0 {
		m.mu.Lock()
		if len(m.replicas) >= maxRemembered {
			clear(m.replicas)
		}
		m.replicas[key] = sent
		m.mu.Unlock()
	}
	return sent, errors.Join(errs...)
}

// Replicas are the peers that took the last replica of conversation key this node pushed
// (nil: none did, or it is forgotten). Each holds the conversation as it was after a turn
// served here: its latest state unless a turn ran here since, and a prefix of it in any
// case, unless that peer has evicted it since.
func (m *Mover) Replicas(key string) []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.replicas[key]
}

func (m *Mover) pushTo(ctx context.Context, to Peer, frame infer.Frame, why Why) error {
	if transfer, recompute, ok := m.worthMoving(to.ID, frame.Len(), frame.Tokens()); !ok {
		return fmt.Errorf("%w: to %s, %d tokens: transfer %v, prefill %v", ErrRecompute, to.ID, frame.Tokens(),
			transfer.Round(time.Millisecond), recompute.Round(time.Millisecond))
	}
	select {
	case m.slots <- struct{}{}:
	default:
		if why == Replica {
			m.transfers.WithLabelValues("sent", "skipped").Inc()
			return fmt.Errorf("%w: replica for %s skipped", ErrBusy, to.ID)
		}
		select {
		case m.slots <- struct{}{}:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	defer func() { <-m.slots }()
	path := hop.KVPath
	if why == Replica {
		path = hop.ReplicaPath
	}
	start := m.now()
	err := m.send(ctx, to, path, frame, why)
	took := m.now().Sub(start)
	m.Observe("sent", frame.Len(), took, err)
	if err == nil && why != Replica {
		m.ring.Happened("handoff", to.ID, fmt.Sprintf("%d tokens, %d KiB, %v", frame.Tokens(), frame.Len()>>10, took.Round(time.Millisecond)))
	}
	if err == nil {
		m.learnRate(to.ID, frame.Len(), took)
		m.learnSize(frame.Len(), frame.Tokens())
	}
	return err
}

// learnRate adds a transfer of size bytes to or from peer that took took to the peer's
// rate (see minRateSample).
func (m *Mover) learnRate(peer string, size int, took time.Duration) {
	if size < minRateSample || took <= 0 {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	rate := float64(size) / took.Seconds()
	if old := m.rates[peer]; old > 0 {
		rate = old + (rate-old)/rateWindow
	}
	m.rates[peer] = rate
}

// learnSize keeps the KV bytes a token of the last frame moved (the model's KV layout).
func (m *Mover) learnSize(size, tokens int) {
	if tokens > 0 {
		m.mu.Lock()
		m.perToken = float64(size) / float64(tokens)
		m.mu.Unlock()
	}
}

// TransferTime estimates how long moving the KV of tokens tokens between this node and
// peer takes, from the frames moved so far and the rate measured to the peer (or the
// bandwidth bound); 0 when either is unknown.
func (m *Mover) TransferTime(peer string, tokens int) time.Duration {
	m.mu.Lock()
	bw, perToken := m.rates[peer], m.perToken
	m.mu.Unlock()
	if m.limit != nil && (bw == 0 || float64(m.limit.Limit()) < bw) {
		bw = float64(m.limit.Limit())
	}
	if bw == 0 || perToken == 0 {
		return 0
	}
	return time.Duration(perToken * float64(tokens) / bw * float64(time.Second))
}

// A peer's transfer rate (Mover.rates) averages pushes of at least minRateSample bytes
// (smaller ones time the round trip and the import, not the link), over about rateWindow
// of them.
const (
	minRateSample = 1 << 20
	rateWindow    = 4
)

// WorthMoving says whether sending a frame of size bytes holding tokens to peer beats
// its prefill (see worthMoving).
func (m *Mover) WorthMoving(peer string, size, tokens int) bool {
	_, _, ok := m.worthMoving(peer, size, tokens)
	return ok
}

// worthMoving estimates how long sending size bytes to peer would take (from past pushes
// to it, and the bandwidth bound) and how long the peer would take to prefill tokens
// (from the rate it gossips; one that has prefilled nothing yet, such as a node that just
// joined, is taken to prefill as fast as this node: it serves the same model), and says
// whether the transfer wins by Config.Margin, counting a decision against as a
// recompute. Either unknown: move it (and so learn the transfer rate).
func (m *Mover) worthMoving(peer string, size, tokens int) (transfer, recompute time.Duration, ok bool) {
	m.mu.Lock()
	bw := m.rates[peer]
	m.mu.Unlock()
	prefill := m.ring.Prefill(peer)
	if prefill == 0 && m.local != nil {
		prefill = m.local.Stats().PrefillRate
	}
	if m.limit != nil && (bw == 0 || float64(m.limit.Limit()) < bw) {
		bw = float64(m.limit.Limit())
	}
	if bw == 0 || prefill == 0 {
		return 0, 0, true
	}
	transfer = time.Duration(float64(size) / bw * float64(time.Second))
	recompute = time.Duration(float64(tokens) / prefill * float64(time.Second))
	ok = float64(transfer)*m.cfg.Margin < float64(recompute)
	if !ok {
		m.transfers.WithLabelValues("sent", "recompute").Inc()
	}
	return transfer, recompute, ok
}

// chunk is the most of a frame sent at once under the bandwidth bound.
const chunk = 64 << 10

// newLimit paces KV pushes to mbit megabits a second (nil: unbounded), in bursts of a
// tenth of a second's worth (at most 1 MiB) beyond a chunk.
func newLimit(mbit float64) *rate.Limiter {
	if mbit <= 0 {
		return nil
	}
	bytes := mbit * 1e6 / 8
	return rate.NewLimiter(rate.Limit(bytes), int(min(bytes/10, 1<<20))+chunk)
}

// paced reads a frame no faster than the mover's bandwidth allows.
type paced struct {
	ctx   context.Context
	r     io.Reader
	limit *rate.Limiter
}

func (p *paced) Read(b []byte) (int, error) {
	n, err := p.r.Read(b[:min(len(b), chunk)])
	if n > 0 {
		if werr := p.limit.WaitN(p.ctx, n); werr != nil {
			return n, werr
		}
	}
	return n, err
}

// frameBody is a request body read from a frame's memory (no goroutine writes it, as a
// pipe needs) that stops reading it once closed: the transport may read a body after Do
// returns (an answer that came before the body's end), and the frame's memory is reused
// once send returns.
type frameBody struct {
	mu sync.Mutex
	r  io.Reader
}

func (b *frameBody) Read(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.r == nil {
		return 0, io.ErrClosedPipe
	}
	return b.r.Read(p)
}

func (b *frameBody) Close() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.r = nil
	return nil
}

// send posts frame to p: written once to hash it for the signature, then read again as
// the request's body (from its memory where it has any, else through a pipe, so that the
// frame is never copied whole).
func (m *Mover) send(ctx context.Context, p Peer, path string, frame infer.Frame, why Why) error {
	ctx, cancel := context.WithTimeout(ctx, m.cfg.Timeout)
	defer cancel()
	hash := hop.NewHash(p.Minor >= hop.MinorBLAKE3)
	if _, err := frame.WriteTo(hash); err != nil {
		return err
	}
	var body io.Reader
	if r, ok := frame.(interface{ Reader() io.Reader }); ok {
		fb := &frameBody{r: r.Reader()}
		defer fb.Close()
		body = fb
	} else {
		pr, pw := io.Pipe()
		written := make(chan struct{})
		go func() {
			defer close(written)
			_, err := frame.WriteTo(pw)
			pw.CloseWithError(err)
		}()
		defer func() { pr.Close(); <-written }() // the frame is the caller's again once this returns
		body = pr
	}
	if m.limit != nil {
		body = &paced{ctx: ctx, r: body, limit: m.limit}
	}
	req, err := http.NewRequestWithContext(ctx, "POST", hop.URL(p.Addr, path), body)
	if err != nil {
		return err
	}
	req.ContentLength = int64(frame.Len())
	req.Header.Set("Content-Type", "application/octet-stream")
	if why == Leaving {
		req.Header.Set(hop.HeaderKVWhy, hop.KVWhyLeaving)
	}
	m.hop.SignHash(req.Header.Set, "POST", path, p.ID, hop.SumFrom(hash))
	resp, err := m.client.Do(req)
	if err != nil {
		return fmt.Errorf("push KV to %s: %w", p.ID, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("push KV to %s: %w", p.ID, hop.DecodeError(resp))
	}
	// Read to its end, so that the connection is kept for the next frame (see
	// routing.New's KV transport).
	_, err = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	return err
}

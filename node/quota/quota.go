package quota

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/infernode/infernode/node/hop"
)

// LeaseTTL is how long a lease may be drawn on; LeaseSpan how many seconds of a bucket's
// rate a node asks for beyond what the request at hand needs, when it asked for the key
// within the last LeaseTTL too (a node that asks more rarely would let the extra expire
// unused, and the cluster would admit less than the limit).
const (
	LeaseTTL  = time.Second
	LeaseSpan = 0.25
)

// Peer is a node that may keep buckets.
type Peer struct {
	ID, Addr string
	Minor    int // the hop minor version it gossips
}

// Ring names the node that keeps a bucket; routing's view implements it.
type Ring interface {
	// Owner is the node that keeps key's bucket on model's ring; self when that is this
	// node (or when there is no ring). Size is how many nodes that ring holds.
	Owner(model, key string) (p Peer, self bool)
	Size(model string) int
}

// Status is what a tenant's answers say of its limits (OpenAI's x-ratelimit headers).
type Status struct {
	Limit                              Limit
	RemainingRequests, RemainingTokens float64
	ResetRequests, ResetTokens         time.Duration
}

// Denied is a request over its tenant's limit.
type Denied struct {
	Kind       string // requests, tokens, or concurrent
	RetryAfter time.Duration
	Too        bool // a request larger than the bucket ever holds
	Status
}

func (d *Denied) Error() string {
	switch {
	case d.Too:
		return fmt.Sprintf("this request needs more %s than the tenant's limit lets it hold at once (a burst): raise the burst or ask for fewer", d.Kind)
	case d.Kind == "concurrent":
		return fmt.Sprintf("rate limit reached: at most %d requests in flight at once on this node", d.Limit.Concurrent)
	}
	return fmt.Sprintf("rate limit reached for %s: retry in %v", d.Kind, d.RetryAfter.Round(time.Millisecond))
}

// Quota is both ends: it admits this node's requests from leases, and keeps the buckets
// this node owns.
type Quota struct {
	log    *slog.Logger
	limits atomic.Pointer[Limits]
	ring   Ring
	hop    *hop.Auth
	client *http.Client
	now    func() time.Time

	mu       sync.Mutex
	buckets  map[string]*owned // buckets this node keeps, by key
	shares   map[string]*owned // this node's share of buckets whose owner cannot be reached
	leases   map[string]*lease // what this node leased, by key
	inflight map[string]int    // requests in flight here, by key

	denied *prometheus.CounterVec
	leased *prometheus.CounterVec
}

type owned struct {
	reqs, toks *bucket
	limit      Limit
	used       time.Time
}

type lease struct {
	reqs, toks float64
	expires    time.Time
	status     Status
	asked      time.Time // when this node last asked for the key's capacity
}

// New builds a quota with limits; a nil ring keeps every bucket here.
func New(limits Limits, ring Ring, auth *hop.Auth, client *http.Client, now func() time.Time, log *slog.Logger) *Quota {
	if log == nil {
		log = slog.Default()
	}
	q := &Quota{log: log.With("component", "quota"), ring: ring, hop: auth, client: client, now: now,
		buckets: map[string]*owned{}, shares: map[string]*owned{}, leases: map[string]*lease{}, inflight: map[string]int{},
		denied: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "infernode_rate_limited_total", Help: "Requests refused (429) for their tenant's limits, by tenant and limit (requests, tokens, concurrent).",
		}, []string{"tenant", "limit"}),
		leased: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "infernode_quota_leases_total", Help: "Leases of tenants' rate-limit buckets this node asked for, by outcome (granted, denied, failed).",
		}, []string{"outcome"}),
	}
	q.SetLimits(limits)
	return q
}

// SetLimits puts limits in force (a reloaded file); leases taken under the old ones lapse.
func (q *Quota) SetLimits(l Limits) {
	q.limits.Store(&l)
	q.mu.Lock()
	clear(q.leases)
	q.mu.Unlock()
}

// Limit is tenant's limit on model, as in force here.
func (q *Quota) Limit(tenant, model string) Limit { return (*q.limits.Load()).Lookup(tenant, model) }

// Collectors are the quota's metrics.
func (q *Quota) Collectors() []prometheus.Collector {
	return []prometheus.Collector{q.denied, q.leased}
}

// Ticket is an admitted request; Settle must follow once it has ended.
type Ticket struct {
	q       *Quota
	key     string
	charged float64
	counted bool
	Status  Status
}

// Settle ends t's request, which used tokens (prompt and answer): what it was charged
// beyond that goes back to this node's lease.
func (t *Ticket) Settle(tokens int) {
	if t == nil || t.q == nil {
		return
	}
	q := t.q
	q.mu.Lock()
	defer q.mu.Unlock()
	if t.counted {
		if q.inflight[t.key]--; q.inflight[t.key] <= 0 {
			delete(q.inflight, t.key)
		}
	}
	if l := q.leases[t.key]; l != nil && q.now().Before(l.expires) && t.charged > float64(tokens) {
		l.toks += t.charged - float64(tokens)
	}
	t.q = nil
}

func bucketKey(tenant, model string) string { return "q:" + tenant + "\x00" + model }

// Admit admits a request of tenant for model that may use tokens (its prompt and
// max_tokens), or refuses it with a *Denied.
func (q *Quota) Admit(ctx context.Context, tenant, model string, tokens int) (*Ticket, error) {
	lim := (*q.limits.Load()).Lookup(tenant, model)
	if lim == (Limit{}) {
		return &Ticket{}, nil
	}
	key := bucketKey(tenant, model)
	t := &Ticket{q: q, key: key, Status: Status{Limit: lim}}
	needR, needT := 0.0, 0.0
	if lim.RPM > 0 {
		needR = 1
	}
	if lim.TPM > 0 {
		needT = float64(tokens)
	}
	q.mu.Lock()
	if lim.Concurrent > 0 && q.inflight[key] >= lim.Concurrent {
		q.mu.Unlock()
		q.denied.WithLabelValues(tenant, "concurrent").Inc()
		return nil, &Denied{Kind: "concurrent", RetryAfter: time.Second, Status: t.Status}
	}
	if needR+needT == 0 || q.draw(key, needR, needT, t) {
		q.admitted(t, lim, needT)
		q.mu.Unlock()
		return t, nil
	}
	l := q.leases[key]
	if l == nil {
		l = &lease{}
		q.leases[key] = l
	}
	haveR, haveT := 0.0, 0.0
	if q.now().Before(l.expires) {
		haveR, haveT = l.reqs, l.toks
	}
	ahead := boolf(q.now().Sub(l.asked) < LeaseTTL)
	l.asked = q.now()
	q.mu.Unlock()

	ask := grant{Tenant: tenant, Model: model,
		LeastR: math.Max(0, needR-haveR), LeastT: math.Max(0, needT-haveT)}
	ask.MostR = ask.LeastR + lim.RPM/60*LeaseSpan*boolf(needR > 0)*ahead
	ask.MostT = ask.LeastT + lim.TPM/60*LeaseSpan*boolf(needT > 0)*ahead
	got, err := q.ask(ctx, key, ask)
	if err != nil {
		// The bucket's owner cannot be reached (dead, until the rings drop it): this node
		// admits on a bucket of its own share of the limit meanwhile, neither refusing
		// everything nor admitting all.
		q.leased.WithLabelValues("failed").Inc()
		q.log.Debug("quota owner unreachable: admitting on this node's share", "tenant", tenant, "err", err)
		got = q.share(key, lim, model, ask)
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	if got.WaitMillis > 0 || got.Too {
		q.leased.WithLabelValues("denied").Inc()
		kind := "requests"
		if got.TokensShort {
			kind = "tokens"
		}
		q.denied.WithLabelValues(tenant, kind).Inc()
		d := &Denied{Kind: kind, RetryAfter: time.Duration(got.WaitMillis) * time.Millisecond, Too: got.Too, Status: got.status(lim)}
		return nil, d
	}
	q.leased.WithLabelValues("granted").Inc()
	l = q.leases[key]
	if !q.now().Before(l.expires) {
		l.reqs, l.toks = 0, 0
	}
	l.reqs, l.toks, l.expires, l.status = l.reqs+got.R, l.toks+got.T, q.now().Add(LeaseTTL), got.status(lim)
	if !q.draw(key, needR, needT, t) {
		// Others drew on the lease meanwhile: what was granted still stands for them.
		q.denied.WithLabelValues(tenant, "requests").Inc()
		return nil, &Denied{Kind: "requests", RetryAfter: 10 * time.Millisecond, Status: l.status}
	}
	q.admitted(t, lim, needT)
	return t, nil
}

func boolf(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// draw takes needs from key's lease when it holds them. Callers hold mu.
func (q *Quota) draw(key string, needR, needT float64, t *Ticket) bool {
	l := q.leases[key]
	if l == nil || !q.now().Before(l.expires) || l.reqs < needR || l.toks < needT {
		return false
	}
	l.reqs, l.toks = l.reqs-needR, l.toks-needT
	t.Status = l.status
	t.Status.RemainingRequests, t.Status.RemainingTokens = math.Floor(l.status.RemainingRequests+l.reqs), math.Floor(l.status.RemainingTokens+l.toks)
	return true
}

// admitted counts t in flight. Callers hold mu.
func (q *Quota) admitted(t *Ticket, lim Limit, charged float64) {
	t.charged = charged
	if lim.Concurrent > 0 {
		q.inflight[t.key]++
		t.counted = true
	}
}

// grant is a lease's hop: asked, and answered.
type grant struct {
	Tenant string  `json:"tenant"`
	Model  string  `json:"model"`
	LeastR float64 `json:"least_r,omitempty"`
	MostR  float64 `json:"most_r,omitempty"`
	LeastT float64 `json:"least_t,omitempty"`
	MostT  float64 `json:"most_t,omitempty"`
	// The answer: granted, or how long until the least is there.
	R           float64 `json:"r,omitempty"`
	T           float64 `json:"t,omitempty"`
	WaitMillis  int64   `json:"wait_ms,omitempty"`
	TokensShort bool    `json:"tokens_short,omitempty"`
	Too         bool    `json:"too,omitempty"`
	LevelR      float64 `json:"level_r"`
	LevelT      float64 `json:"level_t"`
	ResetR      int64   `json:"reset_r_ms"`
	ResetT      int64   `json:"reset_t_ms"`
}

func (g grant) status(lim Limit) Status {
	return Status{Limit: lim, RemainingRequests: math.Floor(g.LevelR), RemainingTokens: math.Floor(g.LevelT),
		ResetRequests: time.Duration(g.ResetR) * time.Millisecond, ResetTokens: time.Duration(g.ResetT) * time.Millisecond}
}

// ask leases from key's owner: this node's own bucket, or a hop to the owner.
func (q *Quota) ask(ctx context.Context, key string, g grant) (grant, error) {
	var owner Peer
	self := true
	if q.ring != nil {
		owner, self = q.ring.Owner(g.Model, key)
	}
	if self {
		return q.take(key, g), nil
	}
	if owner.Minor < hop.MinorQuota {
		return grant{}, fmt.Errorf("owner %s speaks hop 1.%d, before quotas", owner.ID, owner.Minor)
	}
	body, _ := json.Marshal(g)
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, "POST", hop.URL(owner.Addr, hop.QuotaPath), bytes.NewReader(body))
	if err != nil {
		return grant{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	q.hop.Sign(req.Header.Set, "POST", hop.QuotaPath, owner.ID, body)
	nonce := req.Header.Get(hop.HeaderNonce)
	resp, err := q.client.Do(req)
	if err != nil {
		return grant{}, err
	}
	defer resp.Body.Close()
	answer, err := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	if err != nil {
		return grant{}, err
	}
	if resp.StatusCode != http.StatusOK {
		return grant{}, fmt.Errorf("quota owner %s: %s", owner.ID, resp.Status)
	}
	if err := q.hop.VerifyAnswer(resp.Header.Get, hop.QuotaPath, owner.ID, nonce, answer); err != nil {
		return grant{}, err
	}
	var got grant
	if err := json.Unmarshal(answer, &got); err != nil {
		return grant{}, err
	}
	return got, nil
}

// share grants g from this node's share of key's limit (the limit over the ring's nodes).
func (q *Quota) share(key string, lim Limit, model string, g grant) grant {
	n := 1
	if q.ring != nil {
		n = max(1, q.ring.Size(model))
	}
	// No burst beyond a second: the owner's heir starts a full bucket soon.
	part := Limit{RPM: lim.RPM / float64(n), TPM: lim.TPM / float64(n), Burst: min(1, lim.Burst)}
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.grantFrom(q.shares, key, part, g)
}

// maxBuckets bounds the buckets a node keeps; the longest unused go first.
const maxBuckets = 100_000

// take grants g from key's buckets here, both or neither.
func (q *Quota) take(key string, g grant) grant {
	lim := (*q.limits.Load()).Lookup(g.Tenant, g.Model)
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.grantFrom(q.buckets, key, lim, g)
}

// grantFrom grants g from key's buckets in buckets, made for lim. Callers hold mu.
func (q *Quota) grantFrom(buckets map[string]*owned, key string, lim Limit, g grant) grant {
	now := q.now()
	b := buckets[key]
	if b == nil || b.limit != lim {
		if len(buckets) >= maxBuckets {
			evictIdle(buckets, now)
		}
		b = &owned{limit: lim}
		if lim.RPM > 0 {
			b.reqs = newBucket(lim.RPM/60, math.Max(1, lim.RPM/60*lim.Burst), now)
		}
		if lim.TPM > 0 {
			b.toks = newBucket(lim.TPM/60, lim.TPM/60*lim.Burst, now)
		}
		buckets[key] = b
	}
	b.used = now
	out := grant{R: g.MostR, T: g.MostT}
	var waitR, waitT time.Duration
	if b.reqs != nil {
		out.R, waitR = b.reqs.take(g.LeastR, g.MostR, now)
	}
	if b.toks != nil {
		out.T, waitT = b.toks.take(g.LeastT, g.MostT, now)
	}
	if waitR > 0 || waitT > 0 { // all or nothing: put back what was taken
		if b.reqs != nil {
			b.reqs.level += out.R
		}
		if b.toks != nil {
			b.toks.level += out.T
		}
		wait := max(waitR, waitT)
		out = grant{TokensShort: waitT > waitR, Too: wait == time.Duration(math.MaxInt64)}
		if !out.Too {
			out.WaitMillis = max(1, wait.Milliseconds())
		}
	}
	if b.reqs != nil {
		out.LevelR, out.ResetR = b.reqs.level, b.reqs.reset(now).Milliseconds()
	}
	if b.toks != nil {
		out.LevelT, out.ResetT = b.toks.level, b.toks.reset(now).Milliseconds()
	}
	return out
}

// evictIdle drops the buckets unused for a minute (full again by then).
func evictIdle(buckets map[string]*owned, now time.Time) {
	for k, b := range buckets {
		if now.Sub(b.used) > time.Minute {
			delete(buckets, k)
		}
	}
}

// Serve answers a peer's lease hop (authenticated by the caller): the status and the
// body, signed with sign for the asker's nonce.
func (q *Quota) Serve(in hop.Inbound, sign func(name, value string)) (int, []byte) {
	var g grant
	if err := json.Unmarshal(in.Body, &g); err != nil || g.LeastR < 0 || g.LeastT < 0 || g.MostR < g.LeastR || g.MostT < g.LeastT {
		return http.StatusBadRequest, nil
	}
	answer, _ := json.Marshal(q.take(bucketKey(g.Tenant, g.Model), g))
	q.hop.SignAnswer(sign, hop.QuotaPath, in.Header(hop.HeaderFrom), in.Header(hop.HeaderNonce), hop.SumOf(answer, false))
	return http.StatusOK, answer
}

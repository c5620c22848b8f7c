package quota

import (
	"context"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/infernode/infernode/node/hop"
)

type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *clock) Add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

var secret = []byte("0123456789abcdef0123456789abcdef")

// nodes are quotas of one cluster, each behind a real HTTP server that authenticates
// hops as a node does; every bucket is owned by the first.
type nodes struct {
	qs    []*Quota
	peers []Peer
}

type toFirst struct {
	n    *nodes
	self int
}

func (r toFirst) Owner(string, string) (Peer, bool) { return r.n.peers[0], r.self == 0 }
func (r toFirst) Size(string) int                   { return len(r.n.peers) }

func cluster(t *testing.T, n int, limits Limits, c *clock) *nodes {
	ns := &nodes{}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	for i := range n {
		id := string(rune('a' + i))
		auth := hop.NewAuth(id, secret, nil, time.Now, time.Minute)
		var q *Quota
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			body, _ := io.ReadAll(r.Body)
			in := hop.Inbound{Method: r.Method, Path: r.URL.Path, Body: body, Header: r.Header.Get}
			if err := auth.Authenticate(in); err != nil {
				http.Error(w, err.Error(), http.StatusUnauthorized)
				return
			}
			status, answer := q.Serve(in, w.Header().Set)
			w.WriteHeader(status)
			w.Write(answer)
		}))
		t.Cleanup(srv.Close)
		q = New(limits, toFirst{ns, i}, auth, srv.Client(), c.Now, log)
		ns.qs = append(ns.qs, q)
		ns.peers = append(ns.peers, Peer{ID: id, Addr: strings.TrimPrefix(srv.URL, "http://"), Minor: hop.Minor})
	}
	return ns
}

// TestClusterRate: a client that spreads requests over three nodes at five times its
// tenant's limit gets the limit cluster-wide (within 10% over a minute, burst included),
// not three times it; another tenant's bucket is its own; a tenant without limits is not
// held.
func TestClusterRate(t *testing.T) {
	c := &clock{t: time.Unix(1000, 0)}
	limits := Limits{{"alpha", "*"}: {RPM: 120, Burst: DefaultBurst}, {"beta", "*"}: {RPM: 30, Burst: DefaultBurst}}
	ns := cluster(t, 3, limits, c)
	ctx := context.Background()
	admitted := map[string]int{}
	var denied *Denied
	for i := range 6000 { // 60 s, a request of each tenant every 10 ms, round robin over the nodes
		for _, tenant := range []string{"alpha", "beta", "gamma"} {
			tk, err := ns.qs[i%3].Admit(ctx, tenant, "m", 10)
			if err == nil {
				admitted[tenant]++
				tk.Settle(10)
			} else if d, ok := err.(*Denied); ok && denied == nil {
				denied = d
			}
		}
		c.Add(10 * time.Millisecond)
	}
	for tenant, rpm := range map[string]float64{"alpha": 120, "beta": 30} {
		want := rpm + rpm/60*DefaultBurst // a minute's rate and the full bucket it started with
		if got := float64(admitted[tenant]); got < 0.9*rpm || got > 1.1*want {
			t.Errorf("%s admitted %v in a minute through three nodes, want %v to %v", tenant, got, 0.9*rpm, 1.1*want)
		}
	}
	if admitted["gamma"] != 6000 {
		t.Errorf("a tenant without limits was held: %d of 6000", admitted["gamma"])
	}
	if denied == nil || denied.Kind != "requests" || denied.RetryAfter <= 0 || denied.RetryAfter > 2*time.Second || denied.Limit.RPM == 0 {
		t.Errorf("a refusal: %+v", denied)
	}
	t.Logf("alpha %d, beta %d a minute", admitted["alpha"], admitted["beta"])
}

// TestTokensAndConcurrency: tokens are charged as prompt plus max_tokens and what an
// answer did not use comes back; a request larger than the bucket is refused as such; the
// concurrency cap holds on a node and frees as requests end.
func TestTokensAndConcurrency(t *testing.T) {
	c := &clock{t: time.Unix(1000, 0)}
	limits := Limits{{"alpha", "*"}: {TPM: 6000, Burst: 6, Concurrent: 2}} // 100 tokens a second, 600 at once
	q := New(limits, nil, nil, nil, c.Now, nil)
	ctx := context.Background()
	a, err := q.Admit(ctx, "alpha", "m", 400)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := q.Admit(ctx, "alpha", "m", 400); err == nil {
		t.Fatal("a second 400 tokens of a 600-token burst were admitted")
	} else if d := err.(*Denied); d.Kind != "tokens" {
		t.Fatalf("refused as %q", d.Kind)
	}
	a.Settle(50) // it used 50 of its 400: 350 come back
	b, err := q.Admit(ctx, "alpha", "m", 400)
	if err != nil {
		t.Fatalf("after the refund: %v", err)
	}
	b2, err := q.Admit(ctx, "alpha", "m", 1)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := q.Admit(ctx, "alpha", "m", 1); err == nil || err.(*Denied).Kind != "concurrent" {
		t.Fatalf("a third request in flight under a cap of 2: %v", err)
	}
	b.Settle(400)
	b2.Settle(1)
	c.Add(10 * time.Second)
	if _, err := q.Admit(ctx, "alpha", "m", 700); err == nil || !err.(*Denied).Too {
		t.Fatalf("a request larger than the bucket: %v", err)
	}
}

func TestLoadLimits(t *testing.T) {
	path := t.TempDir() + "/limits"
	write := func(s string) {
		if err := writeFile(path, s); err != nil {
			t.Fatal(err)
		}
	}
	write("# limits\ndefault rpm=600 tpm=200000\nalpha rpm=60 concurrent=4\nalpha model=big rpm=6 response_cache=on\n* rpm=10 burst=2\n")
	l, err := Load(path)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		tenant, model string
		want          Limit
	}{
		{"alpha", "small", Limit{RPM: 60, Concurrent: 4, Burst: DefaultBurst}},
		{"alpha", "big", Limit{RPM: 6, Burst: DefaultBurst, CacheAnswers: true}},
		{"default", "x", Limit{RPM: 600, TPM: 200000, Burst: DefaultBurst}},
		{"zeta", "x", Limit{RPM: 10, Burst: 2}},
	} {
		if got := l.Lookup(tc.tenant, tc.model); got != tc.want {
			t.Errorf("%s on %s: %+v, want %+v", tc.tenant, tc.model, got, tc.want)
		}
	}
	for text, want := range map[string]string{"a rpm\n": "key=value", "a rpm=-1\n": ">= 0", "a speed=3\n": "unknown", "a rpm=1\na rpm=2\n": "twice", "a burst=0\n": "burst", "a response_cache=yes\n": "on or off"} {
		write(text)
		if _, err := Load(path); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: %v, want %q", text, err, want)
		}
	}
}

func writeFile(path, s string) error { return os.WriteFile(path, []byte(s), 0o600) }

// TestOwnerUnreachable: while a bucket's owner cannot be reached, each node admits its
// share of the limit (the limit over the nodes), not everything and not nothing.
func TestOwnerUnreachable(t *testing.T) {
	c := &clock{t: time.Unix(1000, 0)}
	ns := cluster(t, 3, Limits{{"alpha", "*"}: {RPM: 120, Burst: DefaultBurst}}, c)
	ns.peers[0].Addr = "127.0.0.1:1" // the owner is gone
	admitted := 0
	for range 1000 { // 10 s at 100 a second through node 2
		if tk, err := ns.qs[1].Admit(context.Background(), "alpha", "m", 1); err == nil {
			admitted++
			tk.Settle(1)
		}
		c.Add(10 * time.Millisecond)
	}
	share := 120.0 / 60 / 3 * 10 // a third of 2 a second, for 10 s
	if got := float64(admitted); got < 0.9*share || got > 1.1*(share+1) {
		t.Errorf("admitted %v in 10 s without the owner, want its share, %v (and a burst)", got, share)
	}
}

// TestSparseDemand: a tenant at twice its limit spread over six nodes sends each node a
// request every few seconds, fewer than a lease holds before it expires. The leases must
// not strand capacity (each lease a quarter second's rate more than its request needed,
// expiring unused, drew more than was admitted: the autoscale scenario measured 12-14%
// under the limit): the tenant gets its limit within 10%.
func TestSparseDemand(t *testing.T) {
	c := &clock{t: time.Unix(1000, 0)}
	const rpm = 60.0
	ns := cluster(t, 6, Limits{{"trial", "*"}: {RPM: rpm, Burst: DefaultBurst}}, c)
	rng := rand.New(rand.NewPCG(1, 2))
	admitted := 0
	for at := time.Duration(0); at < 5*time.Minute; { // Poisson arrivals, two a second, at random nodes
		gap := time.Duration(rng.ExpFloat64() / 2 * float64(time.Second))
		c.Add(gap)
		at += gap
		if tk, err := ns.qs[rng.IntN(6)].Admit(context.Background(), "trial", "m", 10); err == nil {
			admitted++
			tk.Settle(10)
		}
	}
	want := 5*rpm + rpm/60*DefaultBurst
	if got := float64(admitted); got < 0.9*want || got > 1.1*want {
		t.Errorf("admitted %v in five minutes over six nodes, want %v (±10%%)", got, want)
	}
	t.Logf("admitted %d, limit %v", admitted, want)
}

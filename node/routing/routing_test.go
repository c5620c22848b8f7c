package routing

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/infernode/infernode/gossip"
	"github.com/infernode/infernode/internal/poll"
	"github.com/infernode/infernode/node/hop"
	"github.com/infernode/infernode/session/infer"
)

// uninterrupted is what the fake engine answers to a fresh prompt with max tokens n.
func uninterrupted(n int) string {
	var b strings.Builder
	for i := range n {
		b.WriteString(" w" + strconv.Itoa(i))
	}
	return b.String()
}

// servedBy is the node serving st: a routed stream says; a local one is the entry's.
func servedBy(st infer.Stream) string {
	var r *Router
	if node, _, _ := r.Route(st); node != "" {
		return node
	}
	return "a"
}

func resumes(st infer.Stream) int {
	var r *Router
	_, _, n := r.Route(st)
	return n
}

func TestRouting(t *testing.T) {
	for _, tc := range []struct {
		name     string
		owners   []string          // the key's owners, in order
		scripts  map[string]script // by node ("a" is the entry's local engine)
		want     string            // the node that serves the answer
		health   map[string]bool   // peers' health on the entry's ring afterwards (true: still on it)
		resumes  int
		wantErr  bool
		tokens   int // max tokens
		failures int // how many times the request is sent
	}{
		{name: "owner is a peer", owners: []string{"b"}, want: "b", health: map[string]bool{"b": true}},
		{name: "owner is self", owners: []string{"a"}, want: "a"},
		{name: "refused owner: next owner serves, one failed check", owners: []string{"b", "c"},
			scripts: map[string]script{"b": {refuse: true}}, want: "c", health: map[string]bool{"b": true, "c": true}},
		{name: "refused three times: owner off the ring", owners: []string{"b", "c"}, failures: 3,
			scripts: map[string]script{"b": {refuse: true}}, want: "c", health: map[string]bool{"b": false, "c": true}},
		{name: "busy owner spills over and stays healthy", owners: []string{"b", "c"}, failures: 5,
			scripts: map[string]script{"b": {busy: true}}, want: "c", health: map[string]bool{"b": true}},
		{name: "busy local owner spills over", owners: []string{"a", "b"},
			scripts: map[string]script{"a": {busy: true}}, want: "b"},
		{name: "every candidate busy: 503", owners: []string{"b", "c", "a"},
			scripts: map[string]script{"a": {busy: true}, "b": {busy: true}, "c": {busy: true}}, wantErr: true},
		{name: "owner dies mid-stream: resumed exactly", owners: []string{"b", "c"}, tokens: 8,
			scripts: map[string]script{"b": {crashAfter: 3}}, want: "c", resumes: 1, health: map[string]bool{"b": true}},
		{name: "two owners die: resumed twice", owners: []string{"b", "c", "a"}, tokens: 8,
			scripts: map[string]script{"b": {crashAfter: 2}, "c": {crashAfter: 3}}, want: "a", resumes: 2},
		{name: "owner dies after the last token: answer whole", owners: []string{"b", "c"}, tokens: 4,
			scripts: map[string]script{"b": {crashAfter: 4}}, want: "b"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newCluster(t, "b", "c")
			key := c.keyOwnedBy(tc.owners...)
			for id, s := range tc.scripts {
				if id == "a" {
					c.local.set(s)
					continue
				}
				c.peers[id].engine.set(s)
				if s.refuse {
					c.net.add(id+":80", nil)
				}
			}
			tokens := max(tc.tokens, 4)
			for i := range max(tc.failures, 1) {
				st, err := c.entry.Submit(t.Context(), greedy(key, "hello there", tokens))
				if tc.wantErr {
					var e *hop.Error
					if !errors.Is(err, infer.ErrOverloaded) && !(errors.As(err, &e) && e.Status == 503) {
						t.Fatalf("Submit = %v, want the last owner's overload", err)
					}
					return
				}
				if err != nil {
					t.Fatalf("request %d: Submit: %v", i, err)
				}
				text, res := collect(st)
				if res.Err != nil {
					t.Fatalf("request %d: answer failed: %v", i, res.Err)
				}
				if want := uninterrupted(tokens); text != want {
					t.Errorf("request %d: text %q, want %q", i, text, want)
				}
				if res.CompletionTokens != tokens || (tc.want != "a" && res.PromptTokens != 2) {
					t.Errorf("request %d: prompt %d completion %d tokens, want 2 and %d", i, res.PromptTokens, res.CompletionTokens, tokens)
				}
				if node := servedBy(st); node != tc.want {
					t.Errorf("request %d: served by %q, want %q", i, node, tc.want)
				}
				if got := resumes(st); got != tc.resumes && i == 0 {
					t.Errorf("resumes = %d, want %d", got, tc.resumes)
				}
				wantHops := 1
				if tc.want == "a" && tc.resumes == 0 {
					wantHops = 0
				}
				if _, hops, _ := (*Router)(nil).Route(st); hops != wantHops {
					t.Errorf("request %d: hops %v, want %d", i, st, wantHops)
				}
			}
			for id, up := range tc.health {
				if c.onRing(id) != up {
					t.Errorf("%s on the ring = %v, want %v (ring %v)", id, !up, up, c.entry.v.table.Ring().Members())
				}
			}
		})
	}
}

// A peer that takes the request but sends no headers within HeaderTimeout counts as failed
// and the next owner serves; its request is canceled.
// A busy owner's request goes to the least loaded of the next owners, by gossiped load.
func TestSpillLeastLoaded(t *testing.T) {
	c := newCluster(t, "b", "c", "d")
	key := c.keyOwnedBy("b")
	cands := c.entry.v.candidates("", key)
	second, third := cands[1].id, cands[2].id
	members := []member{peerMember("b"), peerMember("c"), peerMember("d")}
	for i := range members {
		if members[i].Meta.ID == second {
			members[i].Meta.Running, members[i].Meta.Waiting = 8, 5
		}
	}
	if second == "a" {
		c.local.set(script{running: 13})
	}
	c.members.set(members...)
	c.entry.v.Sync()
	c.peers["b"].engine.set(script{busy: true})
	st, err := c.entry.Submit(t.Context(), greedy(key, "hello", 4))
	if err != nil {
		t.Fatal(err)
	}
	if _, res := collect(st); res.Err != nil || servedBy(st) != third {
		t.Fatalf("served by %q (err %v), want %s: %s, next in ring order, gossips 13 requests", servedBy(st), res.Err, third, second)
	}
}

// A request every candidate refuses as busy is told to retry when the soonest of them
// expects room, not after a constant.
func TestRetryAfterSoonest(t *testing.T) {
	c := newCluster(t, "b", "c")
	key := c.keyOwnedBy("b", "c", "a")
	c.peers["b"].engine.set(script{busy: true, retry: 9 * time.Second})
	c.peers["c"].engine.set(script{busy: true, retry: 4 * time.Second})
	c.local.set(script{busy: true, retry: 7 * time.Second})
	_, err := c.entry.Submit(t.Context(), greedy(key, "hello", 4))
	if !errors.Is(err, infer.ErrOverloaded) && !errors.As(err, new(*hop.Error)) {
		t.Fatalf("Submit = %v, want overloaded", err)
	}
	if got := retryAfter(err); got != 4*time.Second {
		t.Errorf("retry after %v, want 4s (the soonest of 9s, 4s, 7s)", got)
	}
}

func TestHeaderTimeout(t *testing.T) {
	c := newCluster(t, "b", "c")
	key := c.keyOwnedBy("b", "c")
	c.peers["b"].engine.set(script{hang: true})
	done := make(chan infer.Stream, 1)
	go func() {
		st, err := c.entry.Submit(t.Context(), greedy(key, "hi", 4))
		if err != nil {
			t.Errorf("Submit: %v", err)
		}
		done <- st
	}()
	<-c.peers["b"].engine.started
	c.clock.Advance(c.entry.cfg.HeaderTimeout - time.Millisecond)
	select {
	case <-done:
		t.Fatal("gave up on the owner before the header timeout")
	default:
	}
	c.clock.Advance(time.Millisecond)
	st := <-done
	if node := servedBy(st); node != "c" {
		t.Errorf("served by %q, want c after b timed out", node)
	}
	if text, _ := collect(st); text != uninterrupted(4) {
		t.Errorf("text %q", text)
	}
	for c.peers["b"].engine.canceled.Load() == 0 {
		time.Sleep(time.Millisecond) // the handler sees its context end asynchronously
	}
}

// An owner that stops sending mid-answer (while it would still answer /readyz) fails
// after the progress timeout, not before: the answer resumes on the next owner, exactly.
func TestStalledOwner(t *testing.T) {
	c := newCluster(t, "b", "c")
	key := c.keyOwnedBy("b", "c")
	c.peers["b"].engine.set(script{stallAfter: 3})
	st, err := c.entry.Submit(t.Context(), greedy(key, "hi", 8))
	if err != nil {
		t.Fatal(err)
	}
	var head strings.Builder
	for head.Len() < len(uninterrupted(3)) {
		piece, err := st.Recv()
		if err != nil {
			t.Fatalf("before the stall: %v", err)
		}
		head.WriteString(piece)
	}
	got := make(chan string, 1)
	go func() {
		rest, _ := collect(st)
		got <- head.String() + rest
	}()
	// The entry waits on b's next line (another timer may be pending: only this one counts).
	poll.Until(t, 5*time.Second, "the entry to arm its progress deadline", func() bool {
		return c.clock.pendingIn(c.entry.cfg.ProgressTimeout) > 0
	})
	c.clock.Advance(c.entry.cfg.ProgressTimeout - time.Millisecond)
	if c.clock.pendingIn(time.Millisecond) == 0 {
		t.Fatal("gave up on the owner before the progress timeout")
	}
	c.clock.Advance(time.Millisecond)
	select {
	case text := <-got:
		if text != uninterrupted(8) {
			t.Errorf("text %q, want %q", text, uninterrupted(8))
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the stalled answer did not move on after the progress timeout")
	}
	if servedBy(st) != "c" || resumes(st) != 1 {
		t.Errorf("served by %q after %d resumes, want c after 1 (%v)", servedBy(st), resumes(st), st.Result().Err)
	}
}

// Canceling the client's request crosses the hop: the owner's generation is canceled.
func TestCancelAcrossHop(t *testing.T) {
	c := newCluster(t, "b")
	key := c.keyOwnedBy("b")
	ctx, cancel := context.WithCancel(t.Context())
	st, err := c.entry.Submit(ctx, greedy(key, "hi", 1000))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.Recv(); err != nil {
		t.Fatal(err)
	}
	cancel()
	var rerr error
	for rerr == nil {
		_, rerr = st.Recv()
	}
	if resumes(st) != 0 {
		t.Error("a canceled stream was resumed elsewhere")
	}
	poll.Until(t, 5*time.Second, "the owner's generation to be canceled", func() bool {
		return c.peers["b"].engine.canceled.Load() > 0
	})
}

// A peer announcing a graceful leave gets no new requests at once, without waiting for
// health checks; streams in flight to it are not canceled.
func TestLeavingPeer(t *testing.T) {
	c := newCluster(t, "b", "c")
	key := c.keyOwnedBy("b", "c")
	c.peers["b"].engine.set(script{stallAfter: 3})
	inflight, err := c.entry.Submit(t.Context(), greedy(key, "hi", 10))
	if err != nil {
		t.Fatal(err)
	}
	first, err := inflight.Recv()
	if err != nil {
		t.Fatal(err)
	}
	leaving := peerMember("b")
	leaving.Meta.Leaving = true
	c.members.set(leaving, peerMember("c"))
	c.entry.v.Sync()
	if c.onRing("b") {
		t.Fatal("a leaving peer is still on the ring")
	}
	st, err := c.entry.Submit(t.Context(), greedy(key, "hi", 4))
	if err != nil {
		t.Fatal(err)
	}
	if node := servedBy(st); node != "c" {
		t.Errorf("new request served by %q, want c", node)
	}
	close(c.peers["b"].engine.release) // the leaving node drains its stream
	rest, res := collect(inflight)
	if res.Err != nil || first+rest != uninterrupted(10) || resumes(inflight) != 0 {
		t.Errorf("stream in flight to the leaving peer: %q err %v resumes %d, want it finished there",
			first+rest, res.Err, resumes(inflight))
	}
}

// A peer declared dead leaves the ring and the streams in flight to it are abandoned and
// resumed on the next owner.
func TestDeadPeerCancelsForwards(t *testing.T) {
	c := newCluster(t, "b", "c")
	key := c.keyOwnedBy("b", "c")
	c.peers["b"].engine.set(script{stallAfter: 3}) // a node that stopped answering
	st, err := c.entry.Submit(t.Context(), greedy(key, "hi", 10))
	if err != nil {
		t.Fatal(err)
	}
	first, _ := st.Recv()
	dead := peerMember("b")
	dead.State = gossip.Dead
	c.members.set(dead, peerMember("c"))
	c.entry.v.Sync()
	rest, res := collect(st)
	if res.Err != nil || first+rest != uninterrupted(10) {
		t.Errorf("answer %q err %v", first+rest, res.Err)
	}
	if resumes(st) != 1 || servedBy(st) != "c" {
		t.Errorf("resumes %d on %q, want 1 on c", resumes(st), servedBy(st))
	}
}

// Peers that speak another major version of the hop, serve another model (they are on
// that model's ring), or send invalid metadata stay off the ring; of two live members
// claiming one id, the first keeps it.
func TestEligibility(t *testing.T) {
	c := newCluster(t, "b")
	newer := peerMember("c")
	newer.Meta.Hop = []int{2}
	other := peerMember("d")
	other.Meta.Fingerprint = "another-model"
	invalid := peerMember("e")
	invalid.Invalid = "metadata id does not match"
	impostor := peerMember("b") // an earlier-looking incarnation, seen later
	impostor.Name, impostor.Meta.HTTPAddr = "b#0", "evil:80"
	c.members.set(peerMember("b"), impostor, newer, other, invalid)
	c.entry.v.Sync()
	for range 3 {
		c.entry.v.ProbeAll(t.Context())
	}
	if got := c.entry.v.table.Ring().Members(); strings.Join(got, ",") != "a,b" {
		t.Errorf("ring = %v, want [a b]", got)
	}
	if m := c.entry.v.members["b"]; m.Name != "b#1" {
		t.Errorf("id b held by %q, want b#1, seen first", m.Name)
	}
	reasons := map[string]string{}
	for _, m := range c.entry.View(0).Members {
		reasons[m.ID] = m.Reason
	}
	if reasons["c"] != "hop protocol" || reasons["d"] != "model" {
		t.Errorf("incompatibility reasons = %v", reasons)
	}
	if _, listed := reasons["e"]; listed {
		t.Error("a member with invalid metadata is in the view's ring candidates")
	}
	// Once the holder is dead, a restarted incarnation takes the id over.
	old, restarted := peerMember("b"), peerMember("b")
	old.State, restarted.Name = gossip.Dead, "b#2"
	c.members.set(old, restarted)
	c.entry.v.Sync()
	if m := c.entry.v.members["b"]; m.Name != "b#2" {
		t.Errorf("after b#1 died, id b held by %q, want b#2", m.Name)
	}
}

func TestConfigValidate(t *testing.T) {
	good := testConfig("a", newFakeClock(), nil)
	if err := good.Validate(); err != nil {
		t.Fatalf("good config: %v", err)
	}
	for _, tc := range []struct {
		name string
		edit func(*Config)
		want string
	}{
		{"zero probe interval", func(c *Config) { c.ProbeInterval = 0 }, "probe interval"},
		{"probe timeout over twice the interval", func(c *Config) { c.ProbeTimeout = 2*c.ProbeInterval + 1 }, "probe timeout"},
		{"no secret", func(c *Config) { c.Secret = nil }, "cluster secret is required"},
		{"short secret", func(c *Config) { c.Secret = []byte("short") }, "at least 16 bytes"},
		{"negative header timeout", func(c *Config) { c.HeaderTimeout = -1 }, "header timeout"},
		{"no candidates", func(c *Config) { c.Candidates = 0 }, "candidates"},
		{"bad ring", func(c *Config) { c.Ring.DownAfter = 0 }, "down-after"},
	} {
		cfg := good
		tc.edit(&cfg)
		if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: Validate() = %v, want an error naming %q", tc.name, err, tc.want)
		}
	}
	cfg := good
	cfg.Secret, cfg.Insecure = nil, true
	if err := cfg.Validate(); err != nil {
		t.Errorf("insecure without a secret: %v", err)
	}
}

// TestJoiningNodeSettles: a starting node is not ready while a ready peer gossip shows it
// is not yet on its ring (it would serve every conversation itself, cold); once ready, a
// peer joining after it does not make it unready.
func TestJoiningNodeSettles(t *testing.T) {
	clock := newFakeClock()
	members := &fakeMembers{changes: make(chan struct{}, 1)}
	r, err := New(testConfig("a", clock, &memNet{peers: map[string]http.Handler{"b:80": http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {}), "c:80": http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {})}}), members, newFakeEngine())
	if err != nil {
		t.Fatal(err)
	}
	members.set(peerMember("b"))
	r.v.Sync()
	if ok, why := r.Ready(); ok {
		t.Fatal("ready before its first checks of b")
	} else {
		t.Logf("not ready: %s", why)
	}
	for range r.cfg.Ring.UpAfter {
		r.v.ProbeAll(t.Context())
	}
	if ok, why := r.Ready(); !ok {
		t.Fatalf("b on the ring %v, still not ready: %s", r.v.table.Ring().Members(), why)
	}
	members.set(peerMember("b"), peerMember("c"))
	r.v.Sync()
	if ok, why := r.Ready(); !ok {
		t.Fatalf("unready again when c appeared: %s", why)
	}
}

// big is a router among n in-memory peers that answer their probes (or fail them, when
// told), counting the probes each gets.
type big struct {
	r       *Router
	members *fakeMembers
	mu      sync.Mutex
	hits    map[string]int
	failing map[string]bool
}

func newBig(tb testing.TB, n int) *big {
	clock, mn := newFakeClock(), &memNet{peers: map[string]http.Handler{}}
	c := &big{members: &fakeMembers{changes: make(chan struct{}, 1)}, hits: map[string]int{}, failing: map[string]bool{}}
	ms := make([]member, n)
	for i := range ms {
		id := fmt.Sprintf("p%04d", i)
		ms[i] = peerMember(id)
		mn.add(id+":80", http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			c.mu.Lock()
			defer c.mu.Unlock()
			c.hits[id]++
			if c.failing[id] {
				w.WriteHeader(http.StatusServiceUnavailable)
			}
		}))
	}
	c.members.set(ms...)
	r, err := New(testConfig("a", clock, mn), c.members, newFakeEngine())
	if err != nil {
		tb.Fatal(err)
	}
	c.r = r
	r.v.Sync()
	return c
}

// TestProbeBudget: in a cluster of 1,000 peers a node checks Config.ProbePeers of them a
// round, not all 1,000: newcomers first until they are on its ring, its ring neighbours
// every round, and every peer within about n/ProbePeers rounds; a neighbour that fails
// is off the ring after DownAfter rounds.
func TestProbeBudget(t *testing.T) {
	const n = 1000
	c := newBig(t, n)
	r, mu, hits, failing := c.r, &c.mu, c.hits, c.failing
	budget := r.cfg.ProbePeers
	round := func() map[string]int {
		mu.Lock()
		clear(hits)
		mu.Unlock()
		r.Publish()
		r.v.ProbeAll(t.Context())
		mu.Lock()
		defer mu.Unlock()
		if total := len(hits); total > budget {
			t.Fatalf("one round checked %d peers, budget %d", total, budget)
		}
		return maps.Clone(hits)
	}
	// A join storm: all 1,000 are new to this node.
	rounds, limit := 0, r.cfg.Ring.UpAfter*n/budget+5
	for r.v.table.Ring().Len() < n+1 {
		if rounds++; rounds > limit {
			t.Fatalf("after %d rounds %d of %d peers are on the ring", rounds, r.v.table.Ring().Len(), n+1)
		}
		round()
	}
	t.Logf("a join storm of %d peers: all on the ring after %d rounds of at most %d checks", n, rounds, budget)
	neighbours := r.v.table.Ring().Neighbours("a", r.cfg.Candidates-1)
	if len(neighbours) != 2*(r.cfg.Candidates-1) {
		t.Fatalf("neighbours %v", neighbours)
	}
	seen := map[string]bool{}
	for range n/(budget-len(neighbours)) + 1 {
		hit := round()
		for _, id := range neighbours {
			if hit[id] != 1 {
				t.Fatalf("neighbour %s checked %d times in a round, want 1", id, hit[id])
			}
		}
		for id := range hit {
			seen[id] = true
		}
	}
	if len(seen) != n {
		t.Errorf("%d of %d peers checked in %d rounds", len(seen), n, n/(budget-len(neighbours))+1)
	}
	mu.Lock()
	failing[neighbours[0]] = true
	mu.Unlock()
	for range r.cfg.Ring.DownAfter {
		round()
	}
	if r.v.table.Ring().Has(neighbours[0]) {
		t.Errorf("neighbour %s failed %d checks and is still on the ring", neighbours[0], r.cfg.Ring.DownAfter)
	}
}

// BenchmarkClusterOf1000: what a membership change and a cluster view cost a node among
// 1,000 peers. sync is one peer's readiness flipping, from gossip's list to the new ring;
// view is GET /v1/cluster's body (its size is reported as bytes/view).
//
//	go test ./node/routing -run '^$' -bench ClusterOf1000 -benchmem
func BenchmarkClusterOf1000(b *testing.B) {
	const n = 1000
	c := newBig(b, n)
	for c.r.v.table.Ring().Len() < n+1 {
		c.r.Publish()
		c.r.v.ProbeAll(b.Context())
	}
	// What gossip reports: tags encoded once, as each node encodes its own; a member
	// flips between ready and not.
	raw := c.members.Members()
	flipped := make([][]byte, n)
	for i, m := range c.members.list() {
		m.Meta.Ready = !m.Meta.Ready
		flipped[i], _ = m.Meta.Encode()
	}
	b.Run("sync", func(b *testing.B) {
		i := 0
		for b.Loop() {
			raw[i%n].Tags, flipped[i%n] = flipped[i%n], raw[i%n].Tags
			c.members.setRaw(raw)
			c.r.v.Sync()
			i++
		}
	})
	b.Run("view", func(b *testing.B) {
		size := 0
		for b.Loop() {
			body, err := json.Marshal(c.r.View(0))
			if err != nil {
				b.Fatal(err)
			}
			size = len(body)
		}
		b.ReportMetric(float64(size), "bytes/view")
	})
}

// TestPeerAddresses: a member's gossip and API addresses are peers' (exempt from a
// per-client connection cap); this node's own and anyone else's are not.
func TestPeerAddresses(t *testing.T) {
	c := newCluster(t)
	b, d := peerMember("b"), peerMember("d")
	b.Addr = "10.0.0.2:7946"
	d.Meta.HTTPAddr = "[2001:db8::4]:8080"
	c.members.set(b, d)
	c.entry.v.Sync()
	for addr, want := range map[string]bool{"10.0.0.2": true, "2001:db8::4": true, "::ffff:10.0.0.2": true, "10.0.0.9": false, "127.0.0.1": false} {
		if got := c.entry.Peer(netip.MustParseAddr(addr)); got != want {
			t.Errorf("Peer(%s) = %v, want %v", addr, got, want)
		}
	}
}

// The view a node publishes says a peer is on its ring exactly while requests are routed
// to it: a leaving peer, forgotten by the table as its leave is recorded, stays on the
// ring until the change is committed, and so in the view. (A view that dropped it first
// let the testbed send a turn the ring still gave the leaver.)
func TestViewOnRingIsTheRing(t *testing.T) {
	c := newCluster(t, "b", "c")
	onView := func() bool {
		for _, m := range c.entry.View(0).Members {
			if m.ID == "b" {
				return m.OnRing
			}
		}
		return false
	}
	leaving := peerMember("b")
	leaving.Meta.Leaving = true
	c.members.set(leaving, peerMember("c"))
	c.entry.v.record(c.members.Members())
	if !c.onRing("b") || !onView() {
		t.Fatalf("recorded, not committed: b on the ring %v, in the view %v; want both", c.onRing("b"), onView())
	}
	c.entry.v.commit()
	if c.onRing("b") || onView() {
		t.Fatalf("committed: b on the ring %v, in the view %v; want neither", c.onRing("b"), onView())
	}
}

package gossip

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/infernode/infernode/internal/poll"
)

// testMeta is a schema of tags for these tests, as an application (routing) has one.
type testMeta struct {
	ID       string `json:"id"`
	HTTPAddr string `json:"http,omitempty"`
	Ready    bool   `json:"ready,omitempty"`
	Running  int    `json:"run,omitempty"`
	Waiting  int    `json:"wait,omitempty"`
	QueueCap int    `json:"qcap,omitempty"`
	Leaving  bool   `json:"leaving,omitempty"`
}

func (m testMeta) tags() []byte {
	b, _ := json.Marshal(m)
	return b
}

func decode(b []byte) testMeta {
	var m testMeta
	json.Unmarshal(b, &m)
	return m
}

type testSchema struct{}

func (testSchema) Validate(name string, tags []byte) error {
	if id, _, _ := strings.Cut(name, "#"); decode(tags).ID != id {
		return fmt.Errorf("id %q does not match member name %q", decode(tags).ID, name)
	}
	return nil
}
func (testSchema) Leaving(tags []byte) bool { return decode(tags).Leaving }
func (testSchema) Leave(tags []byte) []byte {
	m := decode(tags)
	m.Leaving = true
	return m.tags()
}
func (testSchema) Urgent(sent, next []byte) bool {
	a, b := decode(sent), decode(next)
	full := func(m testMeta) bool { return m.QueueCap > 0 && m.Waiting >= m.QueueCap }
	return a.Ready != b.Ready || a.Leaving != b.Leaving || full(a) != full(b)
}

func testConfig() Config {
	cfg := DefaultConfig()
	cfg.Schema = testSchema{}
	return cfg
}

func start(t *testing.T, id string, join []string, key []byte) (*Gossip, context.CancelFunc) {
	t.Helper()
	cfg := testConfig()
	cfg.ID, cfg.BindAddr, cfg.BindPort, cfg.Join, cfg.Key = id, "127.0.0.1", 0, join, key
	return startWith(t, cfg)
}

func startWith(t *testing.T, cfg Config) (*Gossip, context.CancelFunc) {
	t.Helper()
	id := cfg.ID
	cfg.Logger = slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelWarn}))
	g, err := New(cfg, testMeta{ID: id, HTTPAddr: "127.0.0.1:1"}.tags())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- g.Run(ctx) }()
	// stop ends Run and waits for it (its last logs go to the test's output, which must
	// still be open); the cleanup calls it too, so it must be safe twice.
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("Run: %v", err)
			}
		})
	}
	t.Cleanup(stop)
	poll.Until(t, 15*time.Second, id+" started", func() bool { return g.Addr() != "" })
	return g, stop
}

func states(g *Gossip) map[string]Member {
	out := map[string]Member{}
	for _, m := range g.Members() {
		out[decode(m.Tags).ID] = m
	}
	return out
}

func TestMembership(t *testing.T) {
	key := []byte("0123456789abcdef")
	a, _ := start(t, "a", nil, key)
	b, stopB := start(t, "b", []string{a.Addr()}, key)
	c, _ := start(t, "c", []string{a.Addr()}, key)
	for _, g := range []*Gossip{a, b, c} {
		poll.Until(t, 15*time.Second, g.Name()+" sees 3 alive members", func() bool {
			s := states(g)
			return len(s) == 3 && s["a"].State == Alive && s["b"].State == Alive && s["c"].State == Alive
		})
	}
	if !strings.HasPrefix(b.Name(), "b#") || !b.Joined() {
		t.Errorf("name %q joined %v", b.Name(), b.Joined())
	}
	if err := b.SetTags(testMeta{ID: "b", HTTPAddr: "127.0.0.1:1", Ready: true, Running: 3}.tags()); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, 15*time.Second, "a sees b's new metadata", func() bool { m := decode(states(a)["b"].Tags); return m.Ready && m.Running == 3 })
	stopB()
	poll.Until(t, 15*time.Second, "a sees b leave", func() bool { return states(a)["b"].State == Left })
	poll.Until(t, 15*time.Second, "c sees b leave", func() bool { return states(c)["b"].State == Left })

	// A node with another key cannot join.
	cfg := testConfig()
	cfg.ID, cfg.BindAddr, cfg.BindPort, cfg.Join = "x", "127.0.0.1", 0, []string{a.Addr()}
	cfg.Key = []byte("fedcba9876543210")
	x, _ := New(cfg, testMeta{ID: "x"}.tags())
	ctx, cancel := context.WithTimeout(t.Context(), 500*time.Millisecond)
	defer cancel()
	x.Run(ctx)
	if x.Joined() || len(states(a)) != 3 {
		t.Errorf("a node with the wrong key joined: %v", states(a))
	}
}

func TestTagsLimit(t *testing.T) {
	if _, err := New(testConfig(), make([]byte, MaxTags+1)); err == nil {
		t.Error("New accepted tags over 512 bytes")
	}
	cfg := testConfig()
	cfg.ID = "a"
	g, err := New(cfg, testMeta{ID: "a"}.tags())
	if err != nil {
		t.Fatal(err)
	}
	if err := g.SetTags(make([]byte, MaxTags+1)); err == nil {
		t.Error("SetTags accepted tags over 512 bytes")
	}
}

// A member whose metadata lies (another id, an address with a path) is listed as invalid,
// so the node never routes to it; dead members are forgotten after ForgetAfter.
func TestInvalidMetaAndPruning(t *testing.T) {
	a, _ := start(t, "a", nil, nil)
	cfg := testConfig()
	cfg.ID, cfg.BindAddr, cfg.BindPort, cfg.Join = "liar", "127.0.0.1", 0, []string{a.Addr()}
	liar, err := New(cfg, testMeta{ID: "a"}.tags())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- liar.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	var got Member
	poll.Until(t, 15*time.Second, "a sees the liar", func() bool {
		for _, m := range a.Members() {
			if strings.HasPrefix(m.Name, "liar#") {
				got = m
				return true
			}
		}
		return false
	})
	if got.Invalid == "" || !strings.Contains(got.Invalid, "does not match") {
		t.Errorf("liar's metadata accepted: %+v", got)
	}
	cancel() // the liar leaves; the cleanup waits for its Run to return
	poll.Until(t, 15*time.Second, "a sees the liar leave", func() bool {
		for _, m := range a.Members() {
			if strings.HasPrefix(m.Name, "liar#") {
				return m.State == Left
			}
		}
		return true
	})
	a.prune(time.Now().Add(a.cfg.ForgetAfter))
	for _, m := range a.Members() {
		if strings.HasPrefix(m.Name, "liar#") {
			t.Errorf("a still lists the departed liar after ForgetAfter: %+v", m)
		}
	}
}

// TestMetaDue: a change of load alone goes out at most every members/LoadUpdates seconds
// (and never sooner than MetaInterval); readiness, a full queue or leaving go out within
// MetaInterval at any size.
func TestMetaDue(t *testing.T) {
	cfg := testConfig()
	cfg.ID = "a"
	base := testMeta{ID: "a", HTTPAddr: "h:1", Ready: true, QueueCap: 4, Running: 1}
	g, err := New(cfg, base.tags())
	if err != nil {
		t.Fatal(err)
	}
	loaded := base
	loaded.Running = 3
	full := loaded
	full.Waiting = 4
	unready := base
	unready.Ready = false
	for _, tc := range []struct {
		name    string
		meta    testMeta
		since   time.Duration
		members int
		want    bool
	}{
		{"nothing changed", base, time.Minute, 3, false},
		{"load, small cluster, after MetaInterval", loaded, cfg.MetaInterval, 3, true},
		{"load, small cluster, before MetaInterval", loaded, cfg.MetaInterval / 2, 3, false},
		{"load, 1,000 members, after 5s", loaded, 5 * time.Second, 1000, false},
		{"load, 1,000 members, after 10s", loaded, 10 * time.Second, 1000, true},
		{"queue full, 1,000 members", full, cfg.MetaInterval, 1000, true},
		{"not ready, 1,000 members", unready, cfg.MetaInterval, 1000, true},
		{"not ready, before MetaInterval", unready, cfg.MetaInterval / 2, 3, false},
	} {
		g.tags = tc.meta.tags()
		if got := g.due(tc.since, tc.members); got != tc.want {
			t.Errorf("%s: due = %v, want %v", tc.name, got, tc.want)
		}
	}
}

// A seed's host name stands for every address it resolves to (a headless service's name
// is every pod): a node joins through the live ones whatever their order, leaves itself
// out, and starts the cluster when the name resolves to itself alone.
func TestJoinByName(t *testing.T) {
	a, _ := start(t, "a", nil, nil)
	_, port, _ := strings.Cut(a.Addr(), ":")
	names := map[string][]string{
		"cluster.test": {"127.0.0.3", "127.0.0.2", "127.0.0.4", "127.0.0.1"}, // only .1 (a) is up; .2 is b
		"solo.test":    {"127.0.0.5"},
	}
	lookup := func(_ context.Context, host string) ([]string, error) {
		if addrs, ok := names[host]; ok {
			return addrs, nil
		}
		return nil, &net.DNSError{Err: "no such host", Name: host, IsNotFound: true}
	}
	node := func(id, ip, seed string) *Gossip {
		cfg := testConfig()
		cfg.ID, cfg.BindAddr, cfg.Join, cfg.LookupHost = id, ip, []string{net.JoinHostPort(seed, port)}, lookup
		cfg.BindPort, _ = strconv.Atoi(port)
		g, _ := startWith(t, cfg)
		return g
	}
	b := node("b", "127.0.0.2", "cluster.test")
	poll.Until(t, 15*time.Second, "b joins a through the name", func() bool {
		return b.Joined() && states(b)["a"].State == Alive && states(a)["b"].State == Alive
	})
	if got, alone := b.seeds(t.Context()); alone || len(got) != 3 || slices.Contains(got, b.Addr()) {
		t.Errorf("b's seeds = %v (alone %v), want the three other addresses", got, alone)
	}
	c := node("c", "127.0.0.5", "solo.test")
	poll.Until(t, 15*time.Second, "c, alone behind its name, starts a cluster", c.Joined)
	d := node("d", "127.0.0.6", "missing.test")
	if got, alone := d.seeds(t.Context()); alone || len(got) != 0 {
		t.Errorf("a name that does not resolve: seeds %v alone %v, want none and not alone", got, alone)
	}
	if d.Joined() {
		t.Error("d joined although its seed does not resolve")
	}
}

// TestProtocolVersions: the protocol versions a node says it speaks reach its peers beside
// its tags, as serf's delegate versions do (memberlist admits a member only while every
// member's current version lies within every other's range).
func TestProtocolVersions(t *testing.T) {
	node := func(id string, join []string, v [3]uint8) *Gossip {
		cfg := testConfig()
		cfg.ID, cfg.BindAddr, cfg.BindPort, cfg.Join, cfg.Protocol = id, "127.0.0.1", 0, join, v
		g, _ := startWith(t, cfg)
		return g
	}
	a := node("a", nil, [3]uint8{1, 4, 4})
	b := node("b", []string{a.Addr()}, [3]uint8{1, 4, 3})
	poll.Until(t, 15*time.Second, "b sees a's protocol versions", func() bool { return states(b)["a"].Protocol == [3]uint8{1, 4, 4} })
	poll.Until(t, 15*time.Second, "a sees b's", func() bool { return states(a)["b"].Protocol == [3]uint8{1, 4, 3} })
}

// TestNotes: a note reaches every member, a newer one replaces it, a member that joins
// later learns it (from the push-pull exchange of its join), and a departed member's note
// is not listed.
func TestNotes(t *testing.T) {
	a, _ := start(t, "a", nil, nil)
	b, stopB := start(t, "b", []string{a.Addr()}, nil)
	c, _ := start(t, "c", []string{a.Addr()}, nil)
	noteOf := func(g *Gossip, from *Gossip) string { return string(g.Notes()[from.Name()]) }
	for _, g := range []*Gossip{a, c} {
		poll.Until(t, 15*time.Second, g.Name()+" sees b", func() bool { return states(g)["b"].State == Alive })
	}
	for _, body := range []string{"first", "second"} {
		if err := b.SetNote([]byte(body)); err != nil {
			t.Fatal(err)
		}
		for _, g := range []*Gossip{a, c} {
			poll.Until(t, 15*time.Second, g.Name()+" has b's note "+body, func() bool { return noteOf(g, b) == body })
		}
	}
	if got := noteOf(b, b); got != "" {
		t.Errorf("a node lists its own note: %q", got)
	}
	// Once no broadcast of it is left to send, only a push-pull exchange can teach it.
	poll.Until(t, 15*time.Second, "b's note no longer broadcast", func() bool {
		return a.queue.NumQueued()+b.queue.NumQueued()+c.queue.NumQueued() == 0
	})
	d, _ := start(t, "d", []string{c.Addr()}, nil)
	poll.Until(t, 15*time.Second, "d, joined later, has b's note", func() bool { return noteOf(d, b) == "second" })
	stopB()
	poll.Until(t, 15*time.Second, "a sees b leave", func() bool { return states(a)["b"].State == Left })
	if got := noteOf(a, b); got != "" {
		t.Errorf("a lists the note of b, which left: %q", got)
	}
	if err := a.SetNote(make([]byte, MaxNote+1)); err == nil {
		t.Error("SetNote accepted a note over MaxNote")
	}
}

// TestDecodeNote: notes from the network are read with every length checked.
func TestDecodeNote(t *testing.T) {
	good := encodeNote(nil, "a#1", &note{version: 7, body: []byte("body")})
	name, n, rest, err := decodeNote(good)
	if err != nil || name != "a#1" || n.version != 7 || string(n.body) != "body" || len(rest) != 0 {
		t.Fatalf("decode = %q %+v %q %v", name, n, rest, err)
	}
	for i := range len(good) {
		if _, _, _, err := decodeNote(good[:i]); err == nil {
			t.Errorf("a note cut to %d bytes decoded", i)
		}
	}
	big := encodeNote(nil, "a#1", &note{body: make([]byte, MaxNote+1)})
	if _, _, _, err := decodeNote(big); err == nil {
		t.Error("a note over MaxNote decoded")
	}
}

// TestSeedReturns: the first node of a cluster (no seeds) leaves and starts again where it
// was, still with no seeds, as in a rolling upgrade: the others find it within a few
// rejoin intervals, not at the next anti-entropy exchange (a minute here), during which
// it would serve alone.
func TestSeedReturns(t *testing.T) {
	key := []byte("0123456789abcdef")
	cfg := func(id string, port int, join []string) Config {
		c := testConfig()
		c.ID, c.BindAddr, c.BindPort, c.Join, c.Key = id, "127.0.0.1", port, join, key
		c.RejoinInterval, c.PushPullInterval = 200*time.Millisecond, time.Minute
		return c
	}
	a, stopA := startWith(t, cfg("a", 0, nil))
	b, _ := startWith(t, cfg("b", 0, []string{a.Addr()}))
	c, _ := startWith(t, cfg("c", 0, []string{a.Addr()}))
	alive := func(g *Gossip) int {
		n := 0
		for _, m := range g.Members() {
			if m.State == Alive {
				n++
			}
		}
		return n
	}
	for _, g := range []*Gossip{a, b, c} {
		poll.Until(t, 15*time.Second, g.Name()+" sees 3 members", func() bool { return alive(g) == 3 })
	}
	_, port, _ := net.SplitHostPort(a.Addr())
	stopA()
	poll.Until(t, 15*time.Second, "b sees a leave", func() bool { return alive(b) == 2 })
	p, _ := strconv.Atoi(port)
	again, _ := startWith(t, cfg("a", p, nil))
	start := time.Now()
	poll.Until(t, 5*time.Second, "a, started again, sees b and c", func() bool { return alive(again) == 3 })
	for _, g := range []*Gossip{b, c} {
		poll.Until(t, 5*time.Second, g.Name()+" sees a again", func() bool { return alive(g) == 3 })
	}
	t.Logf("found again after %v", time.Since(start).Round(time.Millisecond))
}

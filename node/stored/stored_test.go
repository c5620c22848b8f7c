package stored

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/infernode/infernode/node/hop"
)

// fakeClock is a clock the test moves.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) Add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

func record(id string, expires time.Time, size int, items ...string) Record {
	return Record{ID: id, Items: items, Expires: expires.UnixMilli(), Body: []byte(strings.Repeat("x", size))}
}

func TestStoreBoundsAndExpiry(t *testing.T) {
	clock := &fakeClock{t: time.Unix(1000, 0)}
	s := NewStore(10_000, clock.Now)
	later := clock.Now().Add(time.Hour)
	if err := s.Put("k1", record("resp_a", later, 3000, "msg_a")); err != nil {
		t.Fatal(err)
	}
	if err := s.Put("k1", record("resp_b", later, 3000, "msg_b")); err != nil {
		t.Fatal(err)
	}
	// By its id or an item's, only in its conversation.
	for _, id := range []string{"resp_a", "msg_a"} {
		if r, ok := s.Get("k1", id); !ok || r.ID != "resp_a" {
			t.Fatalf("Get(k1, %s) = %v, %v; want resp_a", id, r.ID, ok)
		}
	}
	if _, ok := s.Get("k2", "resp_a"); ok {
		t.Fatal("a record was found in another conversation")
	}
	// resp_a was used last: a third record evicts resp_b, the least recently used.
	if err := s.Put("k2", record("resp_c", later, 4000)); err != nil {
		t.Fatal(err)
	}
	if _, ok := s.Get("k1", "resp_b"); ok {
		t.Fatal("the least recently used record outlived the byte bound")
	}
	if _, ok := s.Get("k1", "resp_a"); !ok {
		t.Fatal("a recently used record was evicted")
	}
	if n, b, evicted, _ := s.Stats(); n != 2 || b > 10_000 || evicted != 1 {
		t.Fatalf("stats: %d records, %d bytes, %d evicted; want 2, <= 10000, 1", n, b, evicted)
	}
	// A record larger than the store, or than MaxRecordBytes, is refused.
	if err := s.Put("k1", record("resp_big", later, 20_000)); err != ErrTooLarge {
		t.Fatalf("an oversized record: %v, want ErrTooLarge", err)
	}
	// Replacing a record keeps one copy.
	if err := s.Put("k1", record("resp_a", later, 100, "msg_a2")); err != nil {
		t.Fatal(err)
	}
	if r, ok := s.Get("k1", "msg_a2"); !ok || len(r.Body) != 100 {
		t.Fatal("the replacement is not the one found")
	}
	if _, ok := s.Get("k1", "msg_a"); ok {
		t.Fatal("the replaced record's items still resolve")
	}
	// Past its expiry a record is gone.
	clock.Add(2 * time.Hour)
	if _, ok := s.Get("k1", "resp_a"); ok {
		t.Fatal("an expired record was found")
	}
	if err := s.Put("k3", record("resp_d", clock.Now().Add(time.Hour), 10)); err != nil {
		t.Fatal(err)
	}
	if n, _, _, _ := s.Stats(); n != 1 {
		t.Fatalf("%d records after expiry and a sweep, want 1", n)
	}
	if !s.Delete("k3", "resp_d") || s.Delete("k3", "resp_d") {
		t.Fatal("Delete must report the record once")
	}
}

// cluster is a ring of keepers, each behind a real HTTP server that authenticates hops
// as a node does. The owner of every key is owners[0], then owners[1], ...; each node's
// heirs are the owners after it (or the owners without it).
type cluster struct {
	nodes  map[string]*member
	owners []string
	down   map[string]bool
}

type member struct {
	k   *Keeper
	srv *httptest.Server
}

var secret = []byte("0123456789abcdef0123456789abcdef")

func newCluster(t *testing.T, ids ...string) *cluster {
	c := &cluster{nodes: map[string]*member{}, owners: ids, down: map[string]bool{}}
	for _, id := range ids {
		auth := hop.NewAuth(id, secret, nil, time.Now, time.Minute)
		m := &member{}
		m.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			body, _ := io.ReadAll(r.Body)
			in := hop.Inbound{Method: r.Method, Path: r.URL.Path, Body: body, Header: r.Header.Get}
			if err := auth.Authenticate(in); err != nil {
				http.Error(w, err.Error(), http.StatusUnauthorized)
				return
			}
			status, answer := m.k.Serve(r.Context(), in, w.Header().Set)
			w.WriteHeader(status)
			w.Write(answer)
		}))
		t.Cleanup(m.srv.Close)
		cfg := DefaultConfig()
		var err error
		if m.k, err = New(cfg, ring{c, id}, auth, m.srv.Client(), time.Now); err != nil {
			t.Fatal(err)
		}
		c.nodes[id] = m
	}
	return c
}

func (c *cluster) peer(id string) Peer {
	return Peer{ID: id, Addr: strings.TrimPrefix(c.nodes[id].srv.URL, "http://"), Minor: hop.Minor}
}

type ring struct {
	c    *cluster
	self string
}

func (r ring) Self() string { return r.self }

func (r ring) live() []string {
	return slices.DeleteFunc(slices.Clone(r.c.owners), func(id string) bool { return r.c.down[id] })
}

func (r ring) Owners(_ string, n int) []Peer {
	var out []Peer
	for _, id := range r.live()[:min(n, len(r.live()))] {
		out = append(out, r.c.peer(id))
	}
	return out
}

func (r ring) Heirs(_ string, n int) []Peer {
	var out []Peer
	for _, id := range r.live() {
		if id != r.self && len(out) < n {
			out = append(out, r.c.peer(id))
		}
	}
	return out
}

func (c *cluster) held(id, key, rec string) bool {
	_, ok := c.nodes[id].k.store.Get(key, rec)
	return ok
}

func TestKeptWithTheConversation(t *testing.T) {
	ctx := context.Background()
	c := newCluster(t, "owner", "heir", "third", "entry")
	c.owners = []string{"owner", "heir", "third", "entry"}
	entry := c.nodes["entry"].k
	rec := Record{ID: "resp_1", Items: []string{"msg_1"}, Expires: entry.Expiry(), Body: []byte(`{"a":1}`)}

	// The entry node sends the record to the node that served the turn, which keeps it
	// and copies it to its heir (one replica), and nowhere else.
	if err := entry.Put(ctx, "conv", rec, "owner"); err != nil {
		t.Fatal(err)
	}
	for id, want := range map[string]bool{"owner": true, "heir": true, "third": false, "entry": false} {
		if got := c.held(id, "conv", "resp_1"); got != want {
			t.Errorf("%s holds the record: %v, want %v", id, got, want)
		}
	}
	// Any node finds it, by its id or its item's.
	for _, id := range []string{"resp_1", "msg_1"} {
		got, err := c.nodes["third"].k.Get(ctx, "conv", id)
		if err != nil || got.ID != "resp_1" || string(got.Body) != `{"a":1}` {
			t.Fatalf("Get(%s) = %+v, %v", id, got, err)
		}
	}
	// The owner dies: its heir, now the owner, still answers.
	c.nodes["owner"].srv.Close()
	c.down["owner"] = true
	if _, err := entry.Get(ctx, "conv", "resp_1"); err != nil {
		t.Fatalf("after the owner died: %v", err)
	}
	// Deleted everywhere: no node finds it after.
	found, err := entry.Delete(ctx, "conv", "resp_1")
	if err != nil || !found {
		t.Fatalf("Delete = %v, %v", found, err)
	}
	for _, id := range []string{"heir", "third", "entry"} {
		if _, err := c.nodes[id].k.Get(ctx, "conv", "resp_1"); err != ErrNotFound {
			t.Fatalf("%s found a deleted record: %v", id, err)
		}
	}
}

func TestHandOff(t *testing.T) {
	ctx := context.Background()
	c := newCluster(t, "a", "b", "c")
	a := c.nodes["a"].k
	for i := range 3 {
		rec := Record{ID: fmt.Sprintf("resp_%d", i), Expires: a.Expiry(), Body: []byte("{}")}
		if err := a.store.Put("conv", rec); err != nil {
			t.Fatal(err)
		}
	}
	// Leaving (the others see a gone): every record goes to a's heir (b), which copies it
	// to its own (c).
	c.down["a"] = true
	if moved := a.HandOff(ctx, true); moved != 3 {
		t.Fatalf("handed off %d records, want 3", moved)
	}
	for _, id := range []string{"b", "c"} {
		if !c.held(id, "conv", "resp_2") {
			t.Errorf("%s does not hold a handed-off record", id)
		}
	}
	// A ring change that makes c the owner: b hands its records to c; a node that still
	// owns its conversations hands nothing.
	c.owners, c.down = []string{"c", "a", "b"}, map[string]bool{}
	c.nodes["c"].k.store.Delete("conv", "resp_1")
	if moved := c.nodes["c"].k.HandOff(ctx, false); moved != 0 {
		t.Fatalf("the owner handed off %d records", moved)
	}
	if moved := c.nodes["b"].k.HandOff(ctx, false); moved != 3 {
		t.Fatalf("b handed off %d records to the new owner, want 3", moved)
	}
	if !c.held("c", "conv", "resp_1") {
		t.Fatal("the new owner lacks a record after the hand-off")
	}
}

func TestForgedAnswersRefused(t *testing.T) {
	ctx := context.Background()
	c := newCluster(t, "owner", "entry")
	// A server at the owner's address that answers without the owner's signature.
	forger := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Write([]byte(`{"id":"resp_1","expires":99999999999999,"body":"e30="}`))
	}))
	defer forger.Close()
	c.nodes["owner"].srv.Close()
	c.nodes["owner"].srv = forger
	if _, err := c.nodes["entry"].k.Get(ctx, "conv", "resp_1"); err != ErrNotFound {
		t.Fatalf("a forged answer was taken: %v", err)
	}
}

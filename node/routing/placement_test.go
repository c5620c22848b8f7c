package routing

import (
	"io"
	"testing"

	"github.com/infernode/infernode/node/kvmove"
	dto "github.com/prometheus/client_model/go"
)

// An owner that holds none of a conversation's KV as its own, running more than the least
// loaded other candidate by the margin, declines it; the entry places it there. One that
// owns the conversation, or is not loaded past the margin, serves it.
func TestPlacementByLoad(t *testing.T) {
	for _, tc := range []struct {
		name         string
		owner        script
		margin       int
		want         string // "b": the owner; "other": a less loaded candidate
		wantDeclined float64
	}{
		{"loaded owner without the conversation declines", script{running: 3, waiting: 1}, 2, "other", 1},
		{"within the margin the owner serves", script{running: 2}, 2, "b", 0},
		{"an owner with the conversation's KV serves", script{running: 6, owns: true}, 2, "b", 0},
		{"an owner with a replica of it serves", script{running: 6, holds: true}, 2, "b", 0},
		{"margin 0: placement off", script{running: 6}, 0, "b", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newCluster(t, "b", "c")
			c.placing()
			c.entry.cfg.PlaceMargin = tc.margin
			key := c.keyOwnedBy("b")
			c.peers["b"].engine.set(tc.owner)
			st, err := c.entry.Submit(t.Context(), greedy(key, "hello", 4))
			if err != nil {
				t.Fatal(err)
			}
			_, res := collect(st)
			got := servedBy(st)
			if res.Err != nil || (tc.want == "b") != (got == "b") {
				t.Fatalf("served by %q (err %v), want %s", got, res.Err, tc.want)
			}
			var m dto.Metric
			c.entry.forwards.WithLabelValues("declined").Write(&m)
			if n := m.GetCounter().GetValue(); n != tc.wantDeclined {
				t.Errorf("declined %v times, want %v", n, tc.wantDeclined)
			}
		})
	}
}

// The entry node, owner of a conversation it does not hold and the more loaded, places
// it on a peer without a hop to itself.
func TestPlacementFromLoadedEntry(t *testing.T) {
	c := newCluster(t, "b", "c")
	c.placing()
	key := c.keyOwnedBy("a")
	c.local.set(script{running: 5})
	st, err := c.entry.Submit(t.Context(), greedy(key, "hello", 4))
	if err != nil {
		t.Fatal(err)
	}
	if _, res := collect(st); res.Err != nil || servedBy(st) == "a" {
		t.Fatalf("served by %q (err %v), want a peer", servedBy(st), res.Err)
	}
	if got := c.local.served.Load(); got != 0 {
		t.Errorf("the loaded entry served %d requests, want 0", got)
	}
}

// A declining owner is asked again, without the choice, when the node it names is busy,
// before any other candidate: placement never turns a request away that the owner could
// serve, nor sends it where its owner did not say.
func TestDeclinedOwnerServesWhenOthersBusy(t *testing.T) {
	c := newCluster(t, "b", "c")
	c.placing()
	key := c.keyOwnedBy("b")
	c.peers["b"].engine.set(script{running: 6})
	c.peers["c"].engine.set(script{busy: true})
	c.local.set(script{busy: true})
	st, err := c.entry.Submit(t.Context(), greedy(key, "hello", 4))
	if err != nil {
		t.Fatal(err)
	}
	if _, res := collect(st); res.Err != nil || servedBy(st) != "b" {
		t.Fatalf("served by %q (err %v), want b, the owner, after the others refused", servedBy(st), res.Err)
	}
	if got := c.peers["b"].engine.served.Load(); got != 1 {
		t.Errorf("b served %d, want 1", got)
	}
}

// placing turns placement on at the entry (a margin of 2) and gives each peer a router
// that sees the cluster (the entry's members, probed up) and has its engine, as an
// owner's side of placement needs.
func (c *cluster) placing() {
	c.entry.cfg.PlaceMargin = 2
	for id, p := range c.peers {
		cfg := testConfig(id, c.clock, c.net)
		cfg.PlaceMargin = c.entry.cfg.PlaceMargin
		r, err := New(cfg, c.members, p.engine)
		if err != nil {
			c.t.Fatal(err)
		}
		r.v.Sync()
		for range r.cfg.Ring.UpAfter {
			r.v.ProbeAll(c.t.Context())
		}
		p.router = r
	}
}

// A conversation placed away from its owner has its next turns declined to the node it was
// placed on, loaded or not, until the owner holds its KV as its own; once that node is no
// candidate, the owner serves them.
func TestPlacedTurnsFollow(t *testing.T) {
	c := newCluster(t, "b", "c")
	members := []member{peerMember("b"), peerMember("c")}
	members[1].Meta.Running = 1 // the entry would place on itself: the owner's choice wins
	c.members.set(members...)
	c.entry.v.Sync()
	c.placing()
	key := c.keyOwnedBy("b")
	b := c.peers["b"]
	b.engine.set(script{running: 6})
	turn := func(want string) { t.Helper(); c.turn(key, want) }
	turn("c") // placed by b, which sees no other candidate
	b.engine.set(script{})
	turn("c") // the owner is idle now, but the conversation is c's
	b.engine.set(script{owns: true})
	turn("b") // the owner holds it as its own (a hand-off, say): served there, and forgotten
	b.engine.set(script{running: 1})
	turn("b")
	if got := b.router.placed.get(key, c.clock.Now()); got != "" {
		t.Errorf("the owner still places the conversation on %q", got)
	}
}

// With replicas on, a conversation's turns follow the load among the nodes where it is
// warm: its owner declines a turn of a conversation it owns to the node that took its last
// replica when that node runs the margin fewer requests (and not before a replica went
// there), and takes a placed conversation back when it holds a replica of it and the node
// it placed it on runs the margin more.
func TestPlacementAmongWarmNodes(t *testing.T) {
	c := newCluster(t, "b", "c")
	c.placing()
	key := c.keyOwnedBy("b", "c")
	b, cc := c.peers["b"], c.peers["c"]
	turn := func(want string) { t.Helper(); c.turn(key, want) }
	gossiped := func(running int) { // c's load, as the others know it
		ms := []member{peerMember("b"), peerMember("c")}
		ms[1].Meta.Running = running
		c.members.set(ms...)
		c.entry.v.Sync()
		b.router.v.Sync()
	}
	b.engine.set(script{running: 6, owns: true})
	turn("b") // loaded, but c holds none of the conversation
	if sent, err := b.router.kv.PushFrame(t.Context(), key, zeros(1000), kvmove.Replica); err != nil || len(sent) != 1 || sent[0] != "c" || cc.replicas != 1 {
		t.Fatalf("replica sent to %v (%v), c took %d, want c", sent, err, cc.replicas)
	}
	b.engine.set(script{running: 2, owns: true})
	turn("b") // c took its replica, but b runs no more than the margin over c's 0
	b.engine.set(script{running: 6, owns: true})
	turn("c") // placed on c, where it is warm
	// c pushed its turn's replica back to b.
	b.engine.set(script{running: 1, holds: true})
	gossiped(3)
	turn("c") // within the margin: the conversation stays on c
	gossiped(4)
	turn("b") // c is the busier by more than the margin: b, which holds the replica, takes it back
	if got := b.router.placed.get(key, c.clock.Now()); got != "" {
		t.Errorf("the owner still places the conversation on %q", got)
	}
}

// zeros is a KV frame of n zero bytes.
type zeros int

func (f zeros) WriteTo(w io.Writer) (int64, error) {
	n, err := w.Write(make([]byte, f))
	return int64(n), err
}
func (f zeros) Len() int  { return int(f) }
func (zeros) Tokens() int { return 10 }
func (zeros) Release()    {}

// turn submits a turn of conversation key at the entry, and fails the test unless want
// served it.
func (c *cluster) turn(key, want string) {
	c.t.Helper()
	st, err := c.entry.Submit(c.t.Context(), greedy(key, "hello", 4))
	if err != nil {
		c.t.Fatal(err)
	}
	if _, res := collect(st); res.Err != nil || servedBy(st) != want {
		c.t.Fatalf("served by %q (err %v), want %s", servedBy(st), res.Err, want)
	}
}

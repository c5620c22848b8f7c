package routing

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/infernode/infernode/node/hop"
	"github.com/infernode/infernode/ring"
	"github.com/infernode/infernode/session/infer"
)

// TestReplicaHeirs: with two replicas, a conversation's copies go to the node that takes
// it over if this one fails, and to the one after that, never to this node or twice.
func TestReplicaHeirs(t *testing.T) {
	c := newCluster(t, "b", "c", "d")
	c.entry.cfg.Replicas = 2
	for i := range 20 {
		key := fmt.Sprint("conv-", i)
		heirs := c.entry.heirs(key, 2)
		if len(heirs) != 2 || heirs[0].id == heirs[1].id || heirs[0].id == "a" || heirs[1].id == "a" {
			t.Fatalf("heirs of %q = %v, want two distinct peers", key, heirs)
		}
		// The first heir owns the key once a has gone; the second once the first has too.
		without := func(gone ...string) string {
			var ms []string
			for _, id := range []string{"a", "b", "c", "d"} {
				if !slices.Contains(gone, id) {
					ms = append(ms, id)
				}
			}
			id, _ := ring.New(c.entry.cfg.Ring, ms).Owner(key)
			return id
		}
		if want := without("a"); heirs[0].id != want {
			t.Errorf("first heir of %q = %s, want %s (its owner without a)", key, heirs[0].id, want)
		}
		if want := without("a", heirs[0].id); heirs[1].id != want {
			t.Errorf("second heir of %q = %s, want %s", key, heirs[1].id, want)
		}
		before := map[string]int{}
		for id, p := range c.peers {
			before[id] = len(p.frames())
		}
		sent, err := c.entry.PushKV(t.Context(), key, testFrame{1000, 10}, Replica)
		if err != nil || !slices.Equal(sent, []string{heirs[0].id, heirs[1].id}) {
			t.Fatalf("replica push sent to %v (%v), want the heirs %v", sent, err, heirs)
		}
		for id, p := range c.peers {
			want := before[id]
			if id == heirs[0].id || id == heirs[1].id {
				want++
			}
			if got := p.frames(); len(got) != want || (len(got) > 0 && want > before[id] && got[len(got)-1] != hop.ReplicaPath) {
				t.Errorf("peer %s took %v after the push, want %d frames, the last a replica", id, got, want)
			}
		}
	}
}

// TestTransferOrRecompute: a conversation moves by transfer only when its frame would
// arrive sooner, by the margin, than its owner would prefill its tokens; unknown rates
// move it (and so measure the link).
func TestTransferOrRecompute(t *testing.T) {
	c := newCluster(t, "b")
	key := c.keyOwnedBy("b")
	push := func(tokens, size int) error {
		_, err := c.entry.PushKV(t.Context(), key, testFrame{size, tokens}, ToOwner)
		return err
	}
	// Nothing known: it moves.
	if err := push(10, 1000); err != nil {
		t.Fatalf("push with no rates known: %v", err)
	}
	b := member("b")
	b.Meta.Prefill = 100 // tokens a second
	c.members.set(b)
	c.entry.Sync()
	for _, tc := range []struct {
		tokens, size int
		move         bool
	}{
		{1000, 1 << 20, true},   // transfer ~1s, prefill 10s
		{100, 1 << 20, false},   // transfer ~1s, prefill 1s
		{100, 900_000, false},   // 0.9s, by the margin 1.125s, against 1s
		{125, 900_000, true},    // 1.125s against 1.25s
		{1, 100_000_000, false}, // 100 MB for a token
	} {
		c.entry.mu.Lock()
		c.entry.kvRates["b"] = 1e6 // bytes a second, as past pushes measured (a push updates it)
		c.entry.mu.Unlock()
		n := len(c.peers["b"].frames())
		err := push(tc.tokens, tc.size)
		moved := len(c.peers["b"].frames()) == n+1
		if tc.move != moved || tc.move != (err == nil) || (!tc.move && !errors.Is(err, ErrRecompute)) {
			t.Errorf("%d tokens in %d bytes: moved %v (%v), want moved %v", tc.tokens, tc.size, moved, err, tc.move)
		}
	}
}

// TestKVBandwidth: pushes keep within the bandwidth bound.
func TestKVBandwidth(t *testing.T) {
	c := newCluster(t, "b")
	c.entry.cfg.KVBandwidth = 8 // Mbit/s: 1 MB a second
	c.entry.kvLimit = newKVLimit(c.entry.cfg.KVBandwidth)
	key := c.keyOwnedBy("b")
	size := 600_000
	start := time.Now()
	if _, err := c.entry.PushKV(t.Context(), key, testFrame{size, 1_000_000}, ToOwner); err != nil {
		t.Fatal(err)
	}
	// The first burst goes at once; the rest at 1 MB a second.
	if took, least := time.Since(start), time.Duration(float64(size-c.entry.kvLimit.Burst())/1e6*float64(time.Second)); took < least {
		t.Errorf("%d bytes at 8 Mbit/s took %v, at least %v expected", size, took, least)
	}
}

// testFrame is a frame of size zero bytes, said to hold tokens.
type testFrame struct{ size, tokens int }

func (f testFrame) WriteTo(w io.Writer) (int64, error) {
	n, err := w.Write(make([]byte, f.size))
	return int64(n), err
}
func (f testFrame) Len() int    { return f.size }
func (f testFrame) Tokens() int { return f.tokens }
func (testFrame) Release()      {}

// importingEngine is a local engine that records the frames imported into it.
type importingEngine struct {
	*fakeEngine
	mu     sync.Mutex
	frames []string
}

func (e *importingEngine) Holds(string) bool { return false }

func (e *importingEngine) Import(_ context.Context, b []byte, _ bool) (infer.Imported, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.frames = append(e.frames, string(b))
	return infer.Imported{}, nil
}

// TestPullOnMiss: the first turn of a conversation this node took over at its last ring
// change pulls its KV from the node that owned it before, once, and the turn is served
// whether the pull worked or not; after the pull window nothing is pulled.
func TestPullOnMiss(t *testing.T) {
	c := newCluster(t, "b", "c")
	c.net.add("c:80", nil) // c is on the ring but does not answer
	local := &importingEngine{fakeEngine: c.local}
	c.entry.local = local
	// a has just joined b and c (as far as pulls go).
	c.entry.mu.Lock()
	c.entry.joined, c.entry.pulled = c.clock.Now(), map[string]bool{}
	c.entry.mu.Unlock()
	var moved, unreachable string
	for i := 0; (moved == "" || unreachable == "") && i < 10000; i++ {
		key := fmt.Sprint("conv-", i)
		was, _ := ring.New(c.entry.cfg.Ring, []string{"b", "c"}).Owner(key)
		now, _ := ring.New(c.entry.cfg.Ring, []string{"a", "b", "c"}).Owner(key)
		switch {
		case now == "a" && was == "b" && moved == "":
			moved = key
		case now == "a" && was == "c" && unreachable == "":
			unreachable = key // c is not on the network: the pull fails, the turn runs cold
		}
	}
	if moved == "" || unreachable == "" {
		t.Fatalf("no key moved from b to a (%q) or from c to a (%q)", moved, unreachable)
	}
	turn := func(key string, followUp bool) infer.Request {
		req := greedy(key, "hi", 2)
		req.FollowUp = followUp
		return req
	}
	// A first turn has nothing to pull.
	st, _ := c.entry.ServeLocal(t.Context(), turn(moved, false))
	collect(st)
	for range 2 {
		for _, key := range []string{moved, unreachable} {
			st, err := c.entry.ServeLocal(t.Context(), turn(key, true))
			if err != nil {
				t.Fatal(err)
			}
			collect(st)
		}
	}
	if !slices.Equal(local.frames, []string{"frame of " + moved}) {
		t.Errorf("imported %q, want only the frame of %s, once", local.frames, moved)
	}
	c.clock.Advance(pullWindow + time.Second)
	c.entry.mu.Lock()
	c.entry.pulled = map[string]bool{}
	c.entry.mu.Unlock()
	st, _ = c.entry.ServeLocal(t.Context(), turn(moved, true))
	collect(st)
	if len(local.frames) != 1 {
		t.Errorf("pulled again after the pull window: %q", local.frames)
	}
}

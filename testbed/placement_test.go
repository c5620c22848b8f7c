package testbed

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/infernode/infernode/internal/poll"
)

// TestPlacementByLoad: through the real binary, a new conversation whose owner runs more
// requests than the other node by more than the margin is placed on the other node, and
// its next turn follows its KV there though the owner is idle by then. Without placement,
// about half of the new conversations would be served by the busy node (each one's owner is
// either node): all 12 on the idle one happens by chance once in 4,096 runs.
func TestPlacementByLoad(t *testing.T) {
	// No hand-off on the ring's first change (a node holding conversations it does not own
	// pushes them to their owners once the ring has settled, which would undo placements
	// made before it), and room for every conversation (LRU eviction would make the second
	// turns cold).
	c := startCluster(t, 2, "--place-margin", "1", "--kv-settle", "1h", "--sequences", "32")
	idle, busy := c.Nodes[0], c.Nodes[1]
	// Two conversations the busy node owns (the idle cluster serves each on its owner),
	// streamed long there: its load is 2 while the short turns below run.
	loads := ownedBy(t, idle, busy, 2, 100, func(i int) []message {
		return []message{{"system", fmt.Sprintf("load %d", i)}, {"user", "tell me everything"}}
	})
	outlasted := loadOn(t, busy, loads)
	declined := func() float64 {
		v, _ := c.Metric(idle, `infernode_forwards_total{outcome="declined"}`)
		return v
	}
	before := declined()
	convs := make([][]message, 12)
	for i := range convs {
		convs[i] = []message{{"system", fmt.Sprintf("placed %d", i)}, {"user", "where does the river run"}}
		// The turn before must have left idle's engine: counted running still, it raises
		// the load the owner may decline above to busy's own (a clean-clone run saw
		// conversation 5 served on busy).
		poll.Until(t, 5*time.Second, "idle's engine to run nothing", func() bool {
			v, err := c.Metric(idle, "infernode_running_sequences")
			return err == nil && v == 0
		})
		a := chat(t, idle.URL(), convs[i], 4)
		if a.status != 200 || a.node != idle.ID {
			t.Errorf("new conversation %d: status %d, served by %s while %s is busy, want %s", i, a.status, a.node, busy.ID, idle.ID)
		}
		convs[i] = append(convs[i], message{"assistant", a.text}, message{"user", "and then"})
	}
	outlasted()
	if declined() == before {
		t.Errorf("no request was declined: none of 12 new conversations is owned by %s?", busy.ID)
	}
	// The owners are idle now: every next turn still goes where its KV is, entering on the
	// node that was busy (the owner of some) and reusing the first turn's cache.
	for i, m := range convs {
		a := chat(t, busy.URL(), m, 4)
		if a.status != 200 || a.node != idle.ID || a.cached == 0 {
			t.Errorf("conversation %d turn 2: status %d, served by %s with %d cached tokens, want %s and its cache", i, a.status, a.node, a.cached, idle.ID)
		}
	}
}

// TestPlacementFollowsLoad: through the real binary, with replicas on (the default), a
// conversation's turns follow the load among the nodes it is warm on. Its owner, running
// more than the margin over the node that took its last replica, declines its next turn
// there, which serves it from the replica; once that node is the busier, the owner, which
// took that node's replica of the turn, serves the next turn itself. Both turns reuse the
// cache of the turn before. Without placement among warm nodes, both would be served
// where the conversation's KV was last its own.
func TestPlacementFollowsLoad(t *testing.T) {
	c := startCluster(t, 2, "--place-margin", "1", "--kv-settle", "1h", "--sequences", "32")
	a, b := c.Nodes[0], c.Nodes[1]
	replicas := func(n *Node) float64 {
		v, _ := c.Metric(n, `infernode_kv_imports_total{origin="replica"}`)
		return v
	}
	// load is n's requests running and waiting as other's gossip tells it.
	load := func(other, n *Node) int {
		v, err := c.View(other)
		if err != nil {
			return -1
		}
		for _, m := range v.Members {
			if m.ID == n.ID {
				return m.Load["running"] + m.Load["waiting"]
			}
		}
		return -1
	}
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		if !poll.Within(30*time.Second, 50*time.Millisecond, cond) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
	// A conversation b owns, its first turn served there and its replica taken by a.
	var conv []message
	for i := 0; conv == nil; i++ {
		if i == 100 {
			t.Fatal("no conversation of 100 is owned by " + b.ID)
		}
		m := []message{{"system", fmt.Sprintf("follows %d", i)}, {"user", "where does the river run"}}
		before := replicas(a)
		if r := chat(t, a.URL(), m, 8); r.node == b.ID {
			conv = append(m, message{"assistant", r.text}, message{"user", "and then"})
			waitFor("b's replica of the first turn on a", func() bool { return replicas(a) > before })
		}
	}
	turn := func(entry *Node, want *Node, why string) {
		t.Helper()
		r := chat(t, entry.URL(), conv, 8)
		if r.status != 200 || r.node != want.ID || r.cached == 0 {
			t.Fatalf("%s: status %d, served by %s with %d of %d prompt tokens cached, want %s and the turn before's cache",
				why, r.status, r.node, r.cached, r.prompt, want.ID)
		}
		conv = append(conv, message{"assistant", r.text}, message{"user", "go on"})
	}

	// b runs two long streams, a none: b declines the next turn to a, which took its replica.
	outlasted := loadOn(t, b, ownedBy(t, a, b, 2, 100, func(i int) []message {
		return []message{{"system", fmt.Sprintf("load b %d", i)}, {"user", "tell me everything"}}
	}))
	waitFor("b to see a idle", func() bool { return load(b, a) == 0 })
	waitFor("a's replicas on b", func() bool { // of the conversations just above that a owns
		v, _ := c.Metric(a, `infernode_kv_transfers_total{direction="sent",outcome="ok"}`)
		return replicas(b) == v
	})
	before := replicas(b)
	turn(a, a, "b loaded")
	outlasted()

	// Now a runs two long streams and b none: b, which took a's replica of that turn,
	// serves the next one.
	waitFor("a's replica of the second turn on b", func() bool { return replicas(b) > before })
	outlasted = loadOn(t, a, ownedBy(t, b, a, 2, 100, func(i int) []message {
		return []message{{"system", fmt.Sprintf("load a %d", i)}, {"user", "tell me everything"}}
	}))
	waitFor("b to see a's load", func() bool { return load(b, a) >= 2 })
	turn(a, b, "a loaded")
	outlasted()
}

// loadOn streams the conversations on n, each long, started one after another (each
// request finds the ones before it running, so no owner sees them all as one). The
// function it returns waits for them to end and fails the test when one ended before
// it was called, or was not served by n.
func loadOn(t *testing.T, n *Node, convs [][]message) (outlasted func()) {
	t.Helper()
	var wg sync.WaitGroup
	t.Cleanup(wg.Wait) // before the cluster stops, when the test ends early
	var mu sync.Mutex
	var ended time.Time
	for _, m := range convs {
		started := make(chan struct{}, 1)
		wg.Go(func() {
			_, node, _, err := streamChat(n.URL(), m, 1200, 1, func() { started <- struct{}{} })
			if err != nil || node != n.ID {
				t.Errorf("load stream: served by %s, %v", node, err)
			}
			mu.Lock()
			if ended.IsZero() {
				ended = time.Now()
			}
			mu.Unlock()
		})
		select {
		case <-started:
		case <-time.After(30 * time.Second):
			t.Fatal("a load stream did not start")
		}
	}
	return func() {
		t.Helper()
		last := time.Now()
		wg.Wait()
		if ended.Before(last) {
			t.Fatalf("a load stream ended too soon: %s was not busy throughout", n.ID)
		}
	}
}

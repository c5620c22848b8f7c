package testbed

import (
	"fmt"
	"sync"
	"testing"
	"time"
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
	// Three conversations the busy node owns (the idle cluster serves each on its owner),
	// streamed long there: its load is 3 while the short turns below run.
	loads := ownedBy(t, idle, busy, 3, 100, func(i int) []message {
		return []message{{"system", fmt.Sprintf("load %d", i)}, {"user", "tell me everything"}}
	})
	var wg sync.WaitGroup
	started := make(chan struct{}, len(loads))
	var mu sync.Mutex
	var ended time.Time
	for _, m := range loads {
		wg.Go(func() {
			_, node, _, err := streamChat(busy.URL(), m, 1200, 1, func() { started <- struct{}{} })
			if err != nil || node != busy.ID {
				t.Errorf("load stream: served by %s, %v", node, err)
			}
			mu.Lock()
			if ended.IsZero() {
				ended = time.Now()
			}
			mu.Unlock()
		})
	}
	for range loads {
		select {
		case <-started:
		case <-time.After(30 * time.Second):
			t.Fatal("the load streams did not start")
		}
	}
	declined := func() float64 {
		v, _ := c.Metric(idle, `infernode_forwards_total{outcome="declined"}`)
		return v
	}
	before := declined()
	convs := make([][]message, 12)
	for i := range convs {
		convs[i] = []message{{"system", fmt.Sprintf("placed %d", i)}, {"user", "where does the river run"}}
		a := chat(t, idle.URL(), convs[i], 4)
		if a.status != 200 || a.node != idle.ID {
			t.Errorf("new conversation %d: status %d, served by %s while %s is busy, want %s", i, a.status, a.node, busy.ID, idle.ID)
		}
		convs[i] = append(convs[i], message{"assistant", a.text}, message{"user", "and then"})
	}
	last := time.Now()
	wg.Wait()
	if ended.Before(last) {
		t.Fatalf("a load stream ended before the new conversations did: the busy node was not busy throughout")
	}
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

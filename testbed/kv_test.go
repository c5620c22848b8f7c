package testbed

import (
	"fmt"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/infernode/infernode/internal/poll"
)

// TestLeaveHandsOffKV: an owner sent SIGTERM pushes the conversations it holds to their
// next owners before it exits, so their next turn, entering anywhere, starts from cache
// and says what the old owner said.
func TestLeaveHandsOffKV(t *testing.T) { testLeave(t) }

// TestLeaveHandsOffKVWithoutFlash: the same on nodes that compute attention without flash
// attention (--flash-attn=false), whose KV states hold V transposed.
func TestLeaveHandsOffKVWithoutFlash(t *testing.T) { testLeave(t, "--flash-attn=false") }

func testLeave(t *testing.T, args ...string) {
	c := startCluster(t, 3, args...)
	entry, victim, other := c.Nodes[0], c.Nodes[1], c.Nodes[2]
	convs := ownedConversations(t, entry, victim, 3)
	if err := victim.signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if !victim.wait(30 * time.Second) {
		t.Fatalf("%s still running 30s after SIGTERM", victim.ID)
	}
	if _, err := c.WaitRings(t.Context(), c.IDs(entry, other), 5*time.Second, victim); err != nil {
		t.Fatal(err)
	}
	checkMoved(t, c, other, victim, convs, "the leave", "handoff")
}

// TestLeaveWarmWhileDraining: a leaving owner is off every ring at once but drains for as
// long as its streams run: its conversations' next turns, sent meanwhile and with no
// replica kept (--replicas 0), start from cache on their heirs (handed off as the drain
// began, or pulled from the leaver on the miss). Before, the hand-off waited for the
// drain's end and these turns ran cold.
func TestLeaveWarmWhileDraining(t *testing.T) {
	c := startCluster(t, 3, "--replicas", "0")
	entry, victim, other := c.Nodes[0], c.Nodes[1], c.Nodes[2]
	convs := ownedConversations(t, entry, victim, 3)
	stream := make(chan error, 1)
	started := make(chan struct{})
	go func() {
		_, _, _, err := streamChat(victim.URL(), []message{{"user", "a stream that holds the drain open"}}, 2000, 1,
			func() { close(started) })
		stream <- err
	}()
	select {
	case <-started:
	case err := <-stream:
		t.Fatalf("the stream on %s: %v", victim.ID, err)
	}
	if err := victim.signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if _, err := c.WaitRings(t.Context(), c.IDs(entry, other), 5*time.Second, victim); err != nil {
		t.Fatal(err)
	}
	checkMoved(t, c, entry, victim, convs, "the leave began", "handoff", "pull")
	select {
	case err := <-stream:
		t.Fatalf("the drain ended (the stream: %v) before the moved turns: the test needs a longer stream", err)
	default:
	}
	if err := <-stream; err != nil {
		t.Errorf("the stream on the leaving node: %v", err)
	}
}

// TestJoinHandsOffKV: when a node joins, the nodes that held the conversations it now owns
// push their caches to it, so their next turn starts there from cache and says what the
// old owner said.
func TestJoinHandsOffKV(t *testing.T) { testJoin(t, true, true) }

// TestJoinWarmAtOnce: the moved conversations' next turns come as soon as the rings
// agree, without waiting for the old owners' pushes: they start from cache too (pushed,
// or pulled by the new owner on its first miss; which one wins is a matter of timing).
func TestJoinWarmAtOnce(t *testing.T) { testJoin(t, true, false) }

// TestJoinRecomputesOnSlowLink: with KV transfers held to 100 kbit/s, moving a cache would
// take longer than the new owner's prefill, so the old owners send nothing and the moved
// conversations are recomputed there, with the same text.
func TestJoinRecomputesOnSlowLink(t *testing.T) { testJoin(t, false, true, "--kv-bandwidth", "0.1") }

// testJoin moves conversations by a join and checks their next turns on the new node:
// warm (transfer) or cold, always with the old owner's text; settle waits for the old
// owners' pushes first.
func testJoin(t *testing.T, transfer, settle bool, args ...string) {
	c := startCluster(t, 2, args...)
	var convs []movedConv
	for i := range 12 {
		m := []message{{"system", fmt.Sprintf("story %d: %s", i, strings.Repeat("a long and winding tale ", 20))}, {"user", "begin"}}
		first := chat(t, c.Nodes[i%2].URL(), m, 120)
		m = append(m, message{"assistant", first.text}, message{"user", "go on"})
		convs = append(convs, movedConv{m, chat(t, c.Nodes[i%2].URL(), m, 60)})
	}
	joined, err := c.Add(t.Context(), "node3")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.WaitRings(t.Context(), c.IDs(), 10*time.Second); err != nil {
		t.Fatal(err)
	}
	// The old owners push once their rings have been quiet for a moment.
	last := 0.0
	if settle {
		last = settledTransfers(t, c, joined)
	}
	recomputed := 0.0
	for _, n := range c.Nodes[:2] {
		v, _ := c.Metric(n, `infernode_kv_transfers_total{direction="sent",outcome="recompute"}`)
		recomputed += v
	}
	moved := 0
	for i, cv := range convs {
		got := chat(t, c.Nodes[0].URL(), cv.msgs, 60)
		if got.node != joined.ID {
			continue
		}
		moved++
		sources := []string{"push"}
		if !settle {
			sources = append(sources, "pull") // a turn sooner than the old owner's push pulls
		}
		if !transfer {
			sources = []string{""}
		}
		if !slices.Contains(sources, got.source) {
			t.Errorf("conversation %d on %s: its cache came as %q, want one of %q", i, got.node, got.source, sources)
		}
		if got.text != cv.want.text || (got.cached > 0) != transfer {
			t.Errorf("conversation %d on %s: %d of %d prompt tokens cached (transfer: %v), %q; the old owner (%s) said %q",
				i, got.node, got.cached, got.prompt, transfer, got.text, cv.want.node, cv.want.text)
		}
	}
	pulled, _ := c.Metric(joined, `infernode_kv_transfers_total{direction="pulled",outcome="ok"}`)
	t.Logf("node3 pulled %v caches", pulled)
	switch {
	case moved == 0:
		t.Error("no conversation moved to node3")
	case !settle:
	case transfer && float64(moved) > last:
		t.Errorf("%d conversations moved to node3, which took %v caches", moved, last)
	case !transfer && (last > 0 || recomputed < float64(moved)):
		t.Errorf("%d conversations moved to node3, which took %v caches; %v left to recompute", moved, last, recomputed)
	}
	t.Logf("%d of %d conversations moved to node3, which took %v caches; %v left to recompute", moved, len(convs), last, recomputed)
}

// settledTransfers waits until the KV frames the nodes given have taken stop growing (none
// for 3s) and returns how many they took.
func settledTransfers(t testing.TB, c *Cluster, nodes ...*Node) float64 {
	t.Helper()
	received := func() float64 {
		sum := 0.0
		for _, n := range nodes {
			v, _ := c.Metric(n, `infernode_kv_transfers_total{direction="received",outcome="ok"}`)
			sum += v
		}
		return sum
	}
	last, since := -1.0, time.Now()
	if !poll.Within(20*time.Second, 100*time.Millisecond, func() bool {
		if n := received(); n != last {
			last, since = n, time.Now()
		}
		return time.Since(since) >= 3*time.Second
	}) {
		t.Fatalf("KV frames still arriving after 20s (%v so far)", last)
	}
	return last
}

// TestCrashFailoverKV: after each turn its owner serves, a conversation's KV is copied to
// the node that takes it over if the owner dies; after kill -9 its next turn starts there
// from the replica and says what the old owner said.
func TestCrashFailoverKV(t *testing.T) {
	// Every conversation probed for its owner stays cached somewhere, and replicas are the
	// first evicted: 16 conversations a node (4x the 4 sequences that run at once) keep the
	// replicas this test looks for. With only as many as run at once (--conversations 4)
	// the probes' conversations evict them and the turns after the crash start cold.
	c := startCluster(t, 3, "--sequences", "4")
	entry, victim, other := c.Nodes[0], c.Nodes[1], c.Nodes[2]
	convs := ownedConversations(t, entry, victim, 3)
	replicas := settledTransfers(t, c, entry, other)
	held := 0.0
	for _, n := range []*Node{entry, other} {
		v, err := c.Metric(n, "infernode_kv_replicas")
		if err != nil {
			t.Fatal(err)
		}
		held += v
	}
	if held < float64(len(convs)) {
		t.Errorf("the survivors hold %v replicas, want at least the %d conversations'", held, len(convs))
	}
	victim.Kill()
	if _, err := c.WaitRings(t.Context(), c.IDs(entry, other), 10*time.Second, victim); err != nil {
		t.Fatal(err)
	}
	checkMoved(t, c, other, victim, convs, "the crash", "replica")

	t.Logf("the survivors took %v replicas before the crash", replicas)
}

// movedConv is a conversation of two turns and the answer its owner gave to the second.
type movedConv struct {
	msgs []message
	want answer
}

// ownedConversations finds n conversations (with long system prompts) that owner serves,
// entering on entry, then runs two turns of each there. It probes for all of them first:
// every probe stays cached somewhere, and the turns' replicas must be the latest.
func ownedConversations(t *testing.T, entry, owner *Node, n int) []movedConv {
	t.Helper()
	owned := ownedBy(t, entry, owner, n, 200, func(i int) []message {
		return []message{{"system", fmt.Sprintf("story %d: %s", i, strings.Repeat("a long and winding tale ", 20))}, {"user", "begin"}}
	})
	var convs []movedConv
	for _, m := range owned {
		first := chat(t, entry.URL(), m, 120)
		m = append(m, message{"assistant", first.text}, message{"user", "go on"})
		want := chat(t, entry.URL(), m, 60)
		if want.node != owner.ID || want.cached == 0 {
			t.Fatalf("the second turn ran on %s with %d cached tokens, want %s with its cache", want.node, want.cached, owner.ID)
		}
		convs = append(convs, movedConv{m, want})
	}
	return convs
}

// checkMoved sends each conversation's second turn again, entering on entry, after its
// owner old is gone: it must run elsewhere, from the cache that came there as one of sources says
// (handoff, replica), and say what old said.
func checkMoved(t *testing.T, c *Cluster, entry, old *Node, convs []movedConv, after string, sources ...string) {
	t.Helper()
	for i, cv := range convs {
		got := chat(t, entry.URL(), cv.msgs, 60)
		switch {
		case got.status != 200 || got.node == old.ID:
			ring, err := c.Ring(entry)
			t.Errorf("conversation %d after %s: status %d, served by %q (%s hops, %d of %d cached, source %q); %s's ring now %v (err %v)",
				i, after, got.status, got.node, got.hops, got.cached, got.prompt, got.source, entry.ID, ring, err)
		case got.cached == 0:
			t.Errorf("conversation %d resumed cold on %s: 0 of %d prompt tokens cached", i, got.node, got.prompt)
		case !slices.Contains(sources, got.source):
			t.Errorf("conversation %d after %s: its cache came to %s as %q, want %q", i, after, got.node, got.source, sources)
		case got.text != cv.want.text:
			t.Errorf("conversation %d on %s: %q, the old owner said %q", i, got.node, got.text, cv.want.text)
		default:
			t.Logf("conversation %d after %s: on %s with %d of %d prompt tokens cached (the old owner had %d)",
				i, after, got.node, got.cached, got.prompt, cv.want.cached)
		}
	}
}

package testbed

import (
	"fmt"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/infernode/infernode/internal/poll"
	"github.com/infernode/infernode/internal/testenv"
)

// TestPrefillElsewhere: a decode node (--role decode) has a prefill node (--role prefill,
// which owns no conversation) prefill each new conversation's prompt and pulls the KV,
// and the answers, with a real model, are those of a node that prefilled them itself, to
// the byte; a follow-up turn starts from the cache already there. A prefill node frozen,
// then killed, while it holds a prompt costs the turn only a local prefill: the answer
// still comes, the same.
func TestPrefillElsewhere(t *testing.T) {
	model := testenv.SharedModel(t, "stories260K.gguf")
	ref := launch(t, Config{Model: model, Nodes: 1})
	c := launch(t, Config{Model: model, Nodes: 1, Args: []string{"--role", "decode", "--replicas", "0"}})
	decode := c.Nodes[0]
	// The prefill node hands no KV off on its ring's changes: once its ring settled after
	// the join, it would push the prompts it prefilled to their owner, where the decode
	// node has them already, and a push landing between the pull and the turn relabels the
	// turn's cache as pushed (seen once in a clean run of make test).
	prefill, err := c.Add(t.Context(), "node2", "--role", "prefill", "--kv-settle", "1h")
	if err != nil {
		t.Fatal(err)
	}
	waitPrefiller(t, c, decode, prefill)
	if _, err := ref.WaitRings(t.Context(), ref.IDs(), 30*time.Second); err != nil {
		t.Fatal(err)
	}
	story := strings.Repeat("Once upon a time there was a little girl who liked to play in the park with her dog. ", 12)
	conv := func(i int) []message {
		return []message{{"system", fmt.Sprintf("Story %d. %s", i, story)}, {"user", "Tell me what happened next."}}
	}
	prefills := func(outcome string) float64 {
		v, _ := c.Metric(decode, fmt.Sprintf(`infernode_remote_prefills_total{outcome=%q}`, outcome))
		return v
	}
	for i := range 3 {
		entry := []*Node{decode, prefill}[i%2]
		m := conv(i)
		want := chat(t, ref.Nodes[0].URL(), m, 48)
		got := chat(t, entry.URL(), m, 48)
		switch {
		case got.status != 200 || got.node != decode.ID:
			t.Fatalf("conversation %d entering at %s: status %d on %q", i, entry.ID, got.status, got.node)
		case got.source != "prefill" || got.cached == 0:
			t.Errorf("conversation %d: its cache came as %q, %d of %d tokens cached; want prefilled elsewhere", i, got.source, got.cached, got.prompt)
		case got.text != want.text:
			t.Errorf("conversation %d: %q, prefilled here it is %q", i, got.text, want.text)
		}
		m = append(m, message{"assistant", got.text}, message{"user", "And then?"})
		want = chat(t, ref.Nodes[0].URL(), append(conv(i), message{"assistant", want.text}, message{"user", "And then?"}), 32)
		if next := chat(t, entry.URL(), m, 32); next.source == "prefill" || next.cached == 0 || next.text != want.text {
			t.Errorf("conversation %d's next turn: source %q, %d cached, %q; want from its cache here, %q", i, next.source, next.cached, next.text, want.text)
		}
	}
	if ok := prefills("ok"); ok != 3 {
		t.Errorf("%v prompts prefilled elsewhere, want 3", ok)
	}

	// The prefill node freezes, then dies, with a prompt in hand.
	if err := prefill.signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	m := conv(99)
	want := chat(t, ref.Nodes[0].URL(), m, 48)
	done := make(chan answer, 1)
	go func() { done <- chat(t, decode.URL(), m, 48) }()
	select { // Not a synchronization: a kill before the request reaches it, or after, ends the same.
	case <-done:
		t.Fatal("answered while the prefill node was frozen with the prompt")
	case <-time.After(time.Second):
	}
	if err := prefill.signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	select {
	case got := <-done:
		if got.status != 200 || got.text != want.text || got.source == "prefill" {
			t.Errorf("after the prefill node died: status %d, source %q, %q; want %q prefilled here", got.status, got.source, got.text, want.text)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("no answer 60s after the prefill node died")
	}
	if failed := prefills("failed"); failed != 1 {
		t.Errorf("%v failed prefills elsewhere, want 1", failed)
	}
}

// waitPrefiller waits until decode sees prefill as a healthy prefill node (it sends it
// prompts from then on).
func waitPrefiller(t testing.TB, c *Cluster, decode, prefill *Node) {
	t.Helper()
	if !poll.Within(30*time.Second, 100*time.Millisecond, func() bool {
		v, err := c.View(decode)
		if err != nil {
			return false
		}
		return slices.ContainsFunc(v.Members, func(m MemberView) bool { return m.ID == prefill.ID && m.Role == "prefill" && m.Healthy })
	}) {
		t.Fatalf("%s never saw %s as a healthy prefill node", decode.ID, prefill.ID)
	}
}

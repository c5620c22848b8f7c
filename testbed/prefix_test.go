package testbed

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/infernode/infernode/internal/poll"
	"github.com/infernode/infernode/internal/testenv"
)

// TestSharedPrefix: conversations that begin with one long system prompt, owned by three
// nodes, have it prefilled once in the whole cluster: the node that served the first one
// gossips a digest of the beginnings it holds, and the owners of the next ones pull the
// beginning's KV from it instead of prefilling it (X-Infernode-KV-Source: prefix). The
// answers, with a real model, are those of a single node that shares the prompt between
// its conversations, to the byte, and the cluster prefills no more than 1.1 times what
// that node prefills for the same conversations (without the digests, every owner
// prefills the prompt once more).
func TestSharedPrefix(t *testing.T) {
	model := testenv.SharedModel(t, "stories260K.gguf")
	ref := launch(t, Config{Model: model, Nodes: 1})
	c := launch(t, Config{Model: model, Nodes: 3, Args: []string{"--replicas", "0"}})
	for _, c := range []*Cluster{ref, c} {
		if _, err := c.WaitRings(t.Context(), c.IDs(), 30*time.Second); err != nil {
			t.Fatal(err)
		}
	}
	system := strings.Repeat("Once upon a time there was a little girl who liked to play in the park with her dog. ", 8)
	conv := func(i int) []message {
		return []message{{"system", system}, {"user", fmt.Sprintf("Tell me about her friend number %d.", i)}}
	}
	first := chat(t, c.Nodes[0].URL(), conv(0), 16)
	if first.status != 200 {
		t.Fatalf("first conversation: status %d", first.status)
	}
	if want := chat(t, ref.Nodes[0].URL(), conv(0), 16); first.text != want.text {
		t.Fatalf("first conversation: %q, on one node %q", first.text, want.text)
	}
	// The others learn what the first one's owner holds from its digest.
	for _, n := range c.Nodes {
		if n.ID == first.node {
			continue
		}
		if !poll.Within(30*time.Second, 100*time.Millisecond, func() bool {
			v, err := c.View(n)
			return err == nil && slices.ContainsFunc(v.Members, func(m MemberView) bool { return m.ID == first.node && m.PrefixDigest > 0 })
		}) {
			t.Fatalf("%s never had %s's digest of prefixes", n.ID, first.node)
		}
	}
	pulled := map[string]bool{}
	for i := 1; i < 9; i++ {
		want := chat(t, ref.Nodes[0].URL(), conv(i), 16)
		got := chat(t, c.Nodes[i%3].URL(), conv(i), 16)
		switch {
		case got.status != 200:
			t.Fatalf("conversation %d: status %d", i, got.status)
		case got.text != want.text:
			t.Errorf("conversation %d on %s: %q, on one node %q", i, got.node, got.text, want.text)
		case got.node != first.node && !pulled[got.node] && (got.source != "prefix" || got.cached < got.prompt/2):
			t.Errorf("conversation %d, the first on %s: its cache came as %q, %d of %d tokens; want the beginning pulled (prefix)",
				i, got.node, got.source, got.cached, got.prompt)
		}
		pulled[got.node] = true
	}
	if len(pulled) < 2 {
		t.Fatalf("the conversations landed on %v only: none to share across nodes", pulled)
	}
	cluster, one := prefilledTokens(t, c, c.Nodes), prefilledTokens(t, c, ref.Nodes)
	t.Logf("prompt tokens prefilled: %v in the cluster, %v on one node", cluster, one)
	if cluster > 1.1*one {
		t.Errorf("the cluster prefilled %v prompt tokens, one node %v: over 1.1x", cluster, one)
	}
}

// prefilledTokens is the prompt tokens nodes prefilled, from their counters: prompt
// tokens less those reused from a conversation's cache or shared from another's.
func prefilledTokens(tb testing.TB, c *Cluster, nodes []*Node) float64 {
	tb.Helper()
	sum := 0.0
	for _, n := range nodes {
		for _, m := range []struct {
			name string
			sign float64
		}{{"infernode_prompt_tokens_total", 1}, {"infernode_reused_prefix_tokens_total", -1}, {"infernode_shared_prefix_tokens_total", -1}} {
			v, err := c.Metric(n, m.name)
			if err != nil {
				tb.Fatal(err)
			}
			sum += m.sign * v
		}
	}
	return sum
}

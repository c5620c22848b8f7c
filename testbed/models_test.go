package testbed

import (
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/infernode/infernode/internal/poll"
	"github.com/infernode/infernode/internal/testenv"
)

// modelList is GET /v1/models as a node answers it.
type modelList struct {
	Data []struct {
		ID    string `json:"id"`
		Nodes int    `json:"nodes"`
		Ready int    `json:"ready_nodes"`
		Local bool   `json:"local"`
	} `json:"data"`
}

func models(t testing.TB, n *Node) (modelList, error) {
	var l modelList
	resp, err := client.Get(n.URL() + "/v1/models")
	if err != nil {
		return l, err
	}
	defer resp.Body.Close()
	err = json.NewDecoder(resp.Body).Decode(&l)
	return l, err
}

// complete sends a greedy text completion for model and returns the text and the node
// that served it.
func complete(t testing.TB, url, model, prompt string, maxTokens int) (status int, text, node string) {
	t.Helper()
	body, _ := json.Marshal(map[string]any{"model": model, "prompt": prompt, "max_tokens": maxTokens, "temperature": 0})
	resp, err := client.Post(url+"/v1/completions", "application/json", strings.NewReader(string(body)))
	if err != nil {
		t.Fatalf("completion: %v", err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var out struct {
		Choices []struct{ Text string }
		Error   struct{ Message string }
	}
	json.Unmarshal(b, &out)
	if len(out.Choices) > 0 {
		text = out.Choices[0].Text
	} else {
		text = out.Error.Message
	}
	return resp.StatusCode, text, resp.Header.Get("X-Infernode-Node")
}

// TestTwoModels: nodes serving two different real models make one cluster with a ring
// for each model. Asked through any node, even one that does not serve it, each model
// answers with its own greedy text, from a node that serves it; /v1/models on every node
// lists both; a model no node serves is a 404 that names them.
func TestTwoModels(t *testing.T) {
	stories := testenv.SharedModel(t, "stories260K.gguf")
	tiny := testenv.SharedModel(t, "tinystories-656k-f32.gguf")
	c := launch(t, Config{Model: stories, Nodes: 2})
	for _, id := range []string{"tiny1", "tiny2"} {
		if _, err := c.Add(t.Context(), id, "--model", tiny); err != nil {
			t.Fatal(err)
		}
	}
	servers := map[string][]string{"stories260K": {"node1", "node2"}, "tinystories-656k-f32": {"tiny1", "tiny2"}}
	start := time.Now()
	if !poll.Within(60*time.Second, 50*time.Millisecond, func() bool {
		for _, n := range c.Nodes {
			l, err := models(t, n)
			if err != nil || len(l.Data) != 2 {
				return false
			}
			for _, m := range l.Data {
				if len(servers[m.ID]) != m.Nodes || m.Ready != m.Nodes || m.Local != slices.Contains(servers[m.ID], n.ID) {
					return false
				}
			}
		}
		return true
	}) {
		for _, n := range c.Nodes {
			l, _ := models(t, n)
			t.Logf("%s: /v1/models %+v", n.ID, l)
		}
		t.Fatal("within 60s, not every node listed both models, each served by two ready nodes")
	}
	t.Logf("both rings ready on every node in %v", time.Since(start).Round(time.Millisecond))

	const prompt = "Once upon a time"
	texts := map[string]string{}
	for model, nodes := range servers {
		for _, n := range c.Nodes {
			status, text, by := complete(t, n.URL(), model, prompt, 60)
			if status != 200 {
				t.Fatalf("%s through %s: %d %s", model, n.ID, status, text)
			}
			if !slices.Contains(nodes, by) {
				t.Errorf("%s through %s was served by %s, which does not serve it", model, n.ID, by)
			}
			if prev, ok := texts[model]; ok && text != prev {
				t.Errorf("%s through %s answered %q, through another node %q", model, n.ID, text, prev)
			}
			texts[model] = text
		}
	}
	if got := texts["stories260K"]; got != testenv.Stories260KOnceUponATime {
		t.Errorf("stories260K answered %q, want llama2.c's reference %q", got, testenv.Stories260KOnceUponATime)
	}
	if texts["tinystories-656k-f32"] == texts["stories260K"] || texts["tinystories-656k-f32"] == "" {
		t.Errorf("tinystories-656k-f32 answered %q, stories260K %q: want two models' different texts",
			texts["tinystories-656k-f32"], texts["stories260K"])
	}
	t.Logf("tinystories-656k-f32 through every node: %q", texts["tinystories-656k-f32"])

	// A chat for a model the entry node does not serve is formatted by a node that does:
	// the same answer through either kind of node.
	for model := range servers {
		var first answer
		for i, n := range c.Nodes {
			a := chatWith(t, n.URL(), map[string]any{"model": model, "max_tokens": 24, "temperature": 0,
				"messages": []message{{"user", fmt.Sprint("Tell me about ", model)}}})
			if a.status != 200 || !slices.Contains(servers[model], a.node) {
				t.Errorf("chat for %s through %s: status %d, served by %q", model, n.ID, a.status, a.node)
			}
			if i == 0 {
				first = a
			} else if a.text != first.text {
				t.Errorf("chat for %s through %s answered %q, through %s %q", model, n.ID, a.text, c.Nodes[0].ID, first.text)
			}
		}
	}

	status, text, _ := complete(t, c.Nodes[0].URL(), "gpt-4", prompt, 4)
	if status != 404 || !strings.Contains(text, `"stories260K"`) || !strings.Contains(text, `"tinystories-656k-f32"`) {
		t.Errorf("a model no node serves: %d %q, want 404 naming both models", status, text)
	}
}

// TestReferenceWithoutFlash: nodes computing attention without flash attention
// (--flash-attn=false) answer llama2.c's reference continuation through either entry,
// share a ring, and gossip a fingerprint other than a default node's (their KV layouts
// differ: V transposed).
func TestReferenceWithoutFlash(t *testing.T) {
	stories := testenv.SharedModel(t, "stories260K.gguf")
	c := launch(t, Config{Model: stories, Nodes: 2, Args: []string{"--flash-attn=false"}})
	if _, err := c.WaitRings(t.Context(), c.IDs(), 30*time.Second); err != nil {
		t.Fatal(err)
	}
	for _, n := range c.Nodes {
		status, text, by := complete(t, n.URL(), "stories260K", "Once upon a time", 60)
		if status != 200 || text != testenv.Stories260KOnceUponATime {
			t.Errorf("through %s (served by %s): %d %q, want llama2.c's reference %q", n.ID, by, status, text, testenv.Stories260KOnceUponATime)
		}
	}
	flash, err := c.Add(t.Context(), "flash", "--flash-attn=true")
	if err != nil {
		t.Fatal(err)
	}
	if !poll.Within(30*time.Second, 50*time.Millisecond, func() bool {
		v, err := c.View(flash)
		return err == nil && len(v.Members) == 3
	}) {
		t.Fatal("the default node did not see the other two within 30s")
	}
	v, err := c.View(flash)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range v.Members[1:] {
		if m.Fingerprint == v.Members[0].Fingerprint {
			t.Errorf("%s (no flash attention) gossips the default node's fingerprint %s", m.ID, m.Fingerprint)
		}
	}
}

package testbed

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/infernode/infernode/internal/testenv"
)

// respTurn is one Responses API answer as the tests read it.
type respTurn struct {
	status int
	node   string // X-Infernode-Node: where it was served
	id     string
	text   string
	cached int
	body   []byte
}

func postResponse(t *testing.T, url string, req map[string]any) respTurn {
	t.Helper()
	body, _ := json.Marshal(req)
	resp, err := client.Post(url+"/v1/responses", "application/json", strings.NewReader(string(body)))
	if err != nil {
		t.Fatalf("responses: %v", err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var out struct {
		ID     string
		Output []struct {
			Type    string
			Content []struct{ Text string }
		}
		Usage struct {
			InputTokensDetails struct {
				CachedTokens int `json:"cached_tokens"`
			} `json:"input_tokens_details"`
		}
	}
	json.Unmarshal(b, &out)
	r := respTurn{status: resp.StatusCode, node: resp.Header.Get("X-Infernode-Node"), id: out.ID, body: b,
		cached: out.Usage.InputTokensDetails.CachedTokens}
	for _, o := range out.Output {
		for _, c := range o.Content {
			r.text += c.Text
		}
	}
	return r
}

func getStatus(t *testing.T, url, id string) int {
	t.Helper()
	resp, err := client.Get(url + "/v1/responses/" + id)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

// TestResponsesChain: a Responses API chain of turns on a real model, each entering at
// another node: every follow-up is routed by its previous_response_id to the
// conversation's owner and is warm there; after the owner is killed between turns, the
// next turn still finds its history (the stored response's copy on the owner's heir) and
// its KV (the replica); after the next owner leaves, the last node still has both (the
// hand-off), and its structured answer (text.format) matches its schema. Each answer equals a plain chat completion of the same conversation, sent
// cold: the history a chain rebuilds is the one the client would have sent.
func TestResponsesChain(t *testing.T) {
	model := testenv.SharedModel(t, "stories260K.gguf")
	c := launch(t, Config{Model: model, Nodes: 3, Args: []string{"--ctx", "8192"}})
	if _, err := c.WaitRings(t.Context(), c.IDs(), 30*time.Second); err != nil {
		t.Fatal(err)
	}
	inputs := []string{"Tim had a red ball.", "Where did he go?", "What did he find?", "How did it end?"}
	var history []message
	// The last turn's answer is structured: a follow-up after a hand-off still matches.
	const schema = `{"type":"object","properties":{"ending":{"type":"string","maxLength":40}},"required":["ending"],"additionalProperties":false}`
	turn := func(i int, entry *Node, prev string) respTurn {
		req := map[string]any{"input": inputs[i], "max_output_tokens": 24, "temperature": 0}
		chat := map[string]any{"max_tokens": 24, "temperature": 0, "session_id": fmt.Sprint("reference-", i)}
		if i == len(inputs)-1 {
			req["max_output_tokens"], chat["max_tokens"] = 80, 80
			req["text"] = map[string]any{"format": map[string]any{"type": "json_schema", "name": "ending", "strict": true, "schema": json.RawMessage(schema)}}
			chat["response_format"] = map[string]any{"type": "json_schema", "json_schema": map[string]any{"name": "ending", "strict": true, "schema": json.RawMessage(schema)}}
		}
		if prev != "" {
			req["previous_response_id"] = prev
		}
		r := postResponse(t, entry.URL(), req)
		if r.status != http.StatusOK || r.id == "" {
			t.Fatalf("turn %d via %s: %d %s", i+1, entry.ID, r.status, r.body)
		}
		history = append(history, message{"user", inputs[i]})
		// The same conversation as a chat, under its own session: cold, and greedy, so
		// it must say the same.
		chat["messages"] = history
		want := chatWith(t, entry.URL(), chat)
		if r.text != want.text {
			t.Errorf("turn %d: the chain answered %q, the same conversation as a chat %q", i+1, r.text, want.text)
		}
		history = append(history, message{"assistant", r.text})
		t.Logf("turn %d via %s, served by %s, %d tokens cached: %q", i+1, entry.ID, r.node, r.cached, r.text)
		return r
	}

	byID := func(id string) *Node {
		n := c.Node(id)
		if n == nil {
			t.Fatalf("no node %q", id)
		}
		return n
	}
	first := turn(0, c.Nodes[0], "")
	owner := byID(first.node)
	var others []*Node
	for _, n := range c.Nodes {
		if n != owner {
			others = append(others, n)
		}
	}
	second := turn(1, others[0], first.id)
	if second.node != owner.ID || second.cached == 0 {
		t.Errorf("turn 2 served by %s with %d tokens cached, want the owner %s, warm", second.node, second.cached, owner.ID)
	}
	for _, n := range c.Nodes {
		if s := getStatus(t, n.URL(), first.id); s != http.StatusOK {
			t.Errorf("GET the first response via %s: %d", n.ID, s)
		}
	}

	// The second turn's replica goes in the background: the kill comes once it has landed.
	settledTransfers(t, c, others...)
	owner.Kill()
	third := turn(2, others[1], second.id)
	if third.node == owner.ID || third.cached == 0 {
		t.Errorf("turn 3 after the owner was killed: served by %s with %d tokens cached, want a survivor, warm", third.node, third.cached)
	}
	if s := getStatus(t, others[0].URL(), first.id); s != http.StatusOK {
		t.Errorf("GET the first response after its owner was killed: %d", s)
	}

	heir := byID(third.node)
	last := others[0]
	if last == heir {
		last = others[1]
	}
	// Once the rings have dropped the killed node, the next owner leaves: it hands its
	// conversations (KV and stored responses) to the last node.
	if _, err := c.WaitRings(t.Context(), c.IDs(others...), 10*time.Second, owner); err != nil {
		t.Fatal(err)
	}
	if err := heir.Stop(30 * time.Second); err != nil {
		t.Fatalf("stop %s: %v", heir.ID, err)
	}
	fourth := turn(3, last, third.id)
	if fourth.node != last.ID || fourth.cached == 0 {
		t.Errorf("turn 4 after the next owner left: served by %s with %d tokens cached, want %s, warm", fourth.node, fourth.cached, last.ID)
	}
	testenv.ValidJSON(t, schema, fourth.text)
}

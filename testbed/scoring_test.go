package testbed

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/infernode/infernode/internal/testenv"
)

// completionOut is a text completion's answer as the scoring tests read it.
type completionOut struct {
	Choices []struct {
		Index    int
		Text     string
		Logprobs struct {
			Tokens        []string             `json:"tokens"`
			TokenLogprobs []*float64           `json:"token_logprobs"`
			TopLogprobs   []map[string]float64 `json:"top_logprobs"`
		}
	}
}

func completeText(t *testing.T, url string, req map[string]any) completionOut {
	t.Helper()
	body, _ := json.Marshal(req)
	resp, err := client.Post(url+"/v1/completions", "application/json", strings.NewReader(string(body)))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var out completionOut
	if err := json.Unmarshal(b, &out); err != nil || resp.StatusCode != 200 {
		t.Fatalf("completion %s: %d %s", body, resp.StatusCode, b)
	}
	return out
}

// TestScoring: what lm-evaluation-harness's local-completions sends for loglikelihood
// tasks, on a real model across two nodes (each prompt on its own owner): a batch of
// prompts as text and as token ids, echo, logprobs 1, max_tokens 1. The prompt's scores
// agree with generation: the log probability the model gave a token when it generated it
// greedily is the one scoring gives it in the same place, and it is the top alternative
// there. A text and its token ids score alike. n choices of one prompt share its cells.
func TestScoring(t *testing.T) {
	model := testenv.SharedModel(t, "stories260K.gguf")
	c := launch(t, Config{Model: model, Nodes: 2, Args: []string{"--ctx", "8192"}})
	if _, err := c.WaitRings(t.Context(), c.IDs(), 30*time.Second); err != nil {
		t.Fatal(err)
	}
	url := c.Nodes[0].URL()
	const text = "Once upon a time, there was a little girl named Lily"

	// Generation: the next token greedily, with its log probability.
	gen := completeText(t, url, map[string]any{"prompt": text, "max_tokens": 1, "temperature": 0, "logprobs": 1})
	next, lp := gen.Choices[0].Logprobs.Tokens[0], *gen.Choices[0].Logprobs.TokenLogprobs[0]

	body, _ := json.Marshal(map[string]any{"content": text + next, "add_special": true})
	resp, err := client.Post(url+"/tokenize", "application/json", strings.NewReader(string(body)))
	if err != nil {
		t.Fatal(err)
	}
	var tok struct{ Tokens []int32 }
	json.NewDecoder(resp.Body).Decode(&tok)
	resp.Body.Close()

	var prompts []any
	for i := range 6 { // other texts, so the batch spreads over both owners
		prompts = append(prompts, fmt.Sprintf("Tom and Sue played %d games", i))
	}
	prompts = append(prompts, text+next, tok.Tokens)
	scored := completeText(t, url, map[string]any{"prompt": prompts, "echo": true, "logprobs": 1, "max_tokens": 1, "temperature": 0})
	if len(scored.Choices) != len(prompts) {
		t.Fatalf("%d choices for %d prompts", len(scored.Choices), len(prompts))
	}
	asText, asIDs := scored.Choices[6].Logprobs, scored.Choices[7].Logprobs
	if n := len(asIDs.TokenLogprobs); n != len(tok.Tokens)+1 || asIDs.TokenLogprobs[0] != nil {
		t.Fatalf("token ids: %d logprobs for %d tokens and 1 generated, the first %v", n, len(tok.Tokens), asIDs.TokenLogprobs[0])
	}
	for i := range asIDs.TokenLogprobs {
		a, b := asText.TokenLogprobs[i], asIDs.TokenLogprobs[i]
		if (a == nil) != (b == nil) || (a != nil && math.Abs(*a-*b) > 1e-4) || asText.Tokens[i] != asIDs.Tokens[i] {
			t.Fatalf("token %d: as text %q %v, as ids %q %v", i, asText.Tokens[i], a, asIDs.Tokens[i], b)
		}
	}
	// The generated token, scored in place: the last prompt token.
	at := len(tok.Tokens) - 1
	got := *asIDs.TokenLogprobs[at]
	if asIDs.Tokens[at] != next || math.Abs(got-lp) > 2e-3 {
		t.Errorf("the generated token %q had log probability %.5f; scored in place, %q has %.5f", next, lp, asIDs.Tokens[at], got)
	}
	if top := asIDs.TopLogprobs[at]; len(top) != 1 || math.Abs(top[next]-got) > 1e-6 {
		t.Errorf("the greedy token is not the top alternative where it was generated: %v", top)
	}
	t.Logf("%q after %q: %.5f generating, %.5f scored", next, text, lp, got)

	// n choices of one prompt: the first prefills it, the others share its cells.
	shared := func() float64 {
		sum := 0.0
		for _, n := range c.Nodes {
			v, _ := c.Metric(n, "infernode_shared_prefix_tokens_total")
			sum += v
		}
		return sum
	}
	before := shared()
	long := strings.Repeat("The sun was warm and the sky was blue. ", 4)
	three := completeText(t, url, map[string]any{"prompt": long, "n": 3, "max_tokens": 8, "temperature": 1, "seed": 7})
	if len(three.Choices) != 3 {
		t.Fatalf("%d choices, want 3", len(three.Choices))
	}
	if d := shared() - before; d < 2*32 {
		t.Errorf("3 choices of a %d-byte prompt shared %v cells, want the prompt's for 2 of them", len(long), d)
	} else {
		t.Logf("3 choices shared %v prompt cells", d)
	}
}

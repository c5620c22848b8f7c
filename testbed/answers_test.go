package testbed

import (
	"encoding/json"
	"testing"
)

// TestResponseCache: a greedy chat that asks for the response cache is computed once, on
// its owner; asked again at another node, it comes back from the owner's cache, the same
// answer to the byte, with no token generated anywhere, usage saying so and every prompt
// token cached. Another sharing domain (cache_salt: another tenant's would do the same),
// another parameter, or a request that does not ask is computed.
func TestResponseCache(t *testing.T) {
	c := startCluster(t, 2)
	msgs := []message{{"system", "You tell short stories."}, {"user", "A story about a river, please."}}
	ask := func(entry int, edit func(map[string]any)) (answer, bool) {
		t.Helper()
		req := map[string]any{"messages": msgs, "max_tokens": 40, "temperature": 0, "response_cache": true}
		if edit != nil {
			edit(req)
		}
		a := chatWith(t, c.Nodes[entry].URL(), req)
		var out struct {
			Usage struct {
				PromptTokens int  `json:"prompt_tokens"`
				Cached       bool `json:"response_cached"`
				Details      struct {
					CachedTokens int `json:"cached_tokens"`
				} `json:"prompt_tokens_details"`
			}
		}
		if err := json.Unmarshal(a.body, &out); err != nil || a.status != 200 {
			t.Fatalf("status %d: %s", a.status, a.body)
		}
		if out.Usage.Cached && out.Usage.Details.CachedTokens != out.Usage.PromptTokens {
			t.Errorf("a cached answer's usage: %d of %d prompt tokens cached", out.Usage.Details.CachedTokens, out.Usage.PromptTokens)
		}
		return a, out.Usage.Cached
	}
	generated := func() float64 {
		sum := 0.0
		for _, n := range c.Nodes {
			v, err := c.Metric(n, "infernode_generated_tokens_total")
			if err != nil {
				t.Fatal(err)
			}
			sum += v
		}
		return sum
	}
	first, cached := ask(0, nil)
	if cached || first.text == "" {
		t.Fatalf("first ask: %q, from the cache %v", first.text, cached)
	}
	before := generated()
	again, cached := ask(1, nil)
	switch {
	case !cached || again.source != "response_cache":
		t.Errorf("asked again at the other node: from the cache %v, source %q", cached, again.source)
	case again.text != first.text || again.node != first.node:
		t.Errorf("asked again: %q on %s, first %q on %s", again.text, again.node, first.text, first.node)
	case generated() != before:
		t.Errorf("asked again: %v tokens generated", generated()-before)
	}
	if hits, _ := c.Metric(c.Node(first.node), "infernode_response_cache_hits_total"); hits != 1 {
		t.Errorf("the owner counts %v hits, want 1", hits)
	}
	for name, edit := range map[string]func(map[string]any){
		"another sharing domain": func(r map[string]any) { r["cache_salt"] = "team-b" },
		"another max_tokens":     func(r map[string]any) { r["max_tokens"] = 41 },
		"not asked":              func(r map[string]any) { delete(r, "response_cache") },
		"sampled":                func(r map[string]any) { r["temperature"] = 0.8 },
	} {
		before := generated()
		if _, cached := ask(1, edit); cached || generated() == before {
			t.Errorf("%s: from the cache %v, %v tokens generated", name, cached, generated()-before)
		}
	}
}

package testbed

import (
	"bytes"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// BenchmarkSharedPrompt: 30 conversations that begin with one system prompt of about
// 1,000 tokens, spread over the owners of a 3-node cluster, arriving in a fixed pattern:
// the first alone; when it has answered, a pause of sharedPause (the digests' period and
// their gossip); then the 29 others, one every sharedEvery, entering at the three nodes
// in turn, without waiting for each other (open loop). Each asks for sharedTokens tokens,
// streamed. Run three ways: the cluster with prefix digests (the default), the cluster
// without (--share-prefixes=false: every owner prefills the prompt once), and one node
// alone (the prompt prefilled once, shared by its conversations: the ideal the cluster is
// held to). Reported: the prompt tokens prefilled in the whole cluster (prompt tokens
// less those reused or shared, summed over the nodes' counters), the system prompt's
// prefills (1 + the cluster's excess over one node, in prompt lengths), the first turns'
// time to first token (p50, p90, p99) and the beginnings pulled. The model is
// INFERNODE_BENCH_MODEL (make bench-shared-prompt).
func BenchmarkSharedPrompt(b *testing.B) {
	model := benchModel(b)
	vocab := strings.Fields("the river runs past the old stone bridge where the village keeps its market on quiet mornings and the light comes through the forest in long bands")
	var sb strings.Builder
	sb.WriteString("You are the archivist of a village. Answer from this record only.")
	for w := range 760 {
		sb.WriteString(" " + vocab[(w*7+w/5)%len(vocab)])
	}
	system := sb.String()
	var one float64
	for _, mode := range []string{"one-node", "no-digests", "digests"} {
		b.Run(mode, func(b *testing.B) {
			var ttft []time.Duration
			var prefilled, pulled, promptLen float64
			for b.Loop() {
				nodes, args := 3, []string{"--threads", "1", "--replicas", "0", "--log-level", "info"}
				switch mode {
				case "one-node":
					nodes = 1
				case "no-digests":
					args = append(args, "--share-prefixes=false")
				}
				c, err := Start(b.Context(), Config{Binary: binary, Model: model, Nodes: nodes, LogDir: b.TempDir(), Args: args})
				if err != nil {
					b.Fatal(err)
				}
				if _, err := c.WaitRings(b.Context(), c.IDs(), 30*time.Second); err != nil {
					c.Close()
					b.Fatal(err)
				}
				promptLen = float64(tokenCount(b, c.Nodes[0], system))
				ttft = append(ttft, sharedPromptLoad(b, c, system)...)
				prefilled, pulled = prefilledTokens(b, c, c.Nodes), 0
				for _, n := range c.Nodes {
					v, _ := c.Metric(n, `infernode_prefix_pulls_total{outcome="ok"}`)
					pulled += v
				}
				c.Close()
			}
			if mode == "one-node" {
				one = prefilled
			}
			slices.Sort(ttft)
			ms := func(p float64) float64 {
				return float64(ttft[min(len(ttft)-1, int(float64(len(ttft))*p))].Microseconds()) / 1000
			}
			b.ReportMetric(prefilled, "tokens-prefilled")
			b.ReportMetric(promptLen, "prompt-tokens")
			if one > 0 {
				b.ReportMetric(1+(prefilled-one)/promptLen, "prompt-prefills")
			}
			b.ReportMetric(ms(0.5), "ttft-p50-ms")
			b.ReportMetric(ms(0.9), "ttft-p90-ms") // of 30: the third slowest, where the other owners' cold prefills show
			b.ReportMetric(ms(0.99), "ttft-p99-ms")
			b.ReportMetric(pulled, "beginnings-pulled")
			b.ReportMetric(0, "ns/op")
		})
	}
}

// The shared prompt's arrival pattern (see BenchmarkSharedPrompt).
const (
	sharedConversations = 30
	sharedPause         = 2 * time.Second
	sharedEvery         = 300 * time.Millisecond
	sharedTokens        = 8
)

// sharedPromptLoad runs the shared prompt's conversations on c and returns their times to
// first token.
func sharedPromptLoad(b *testing.B, c *Cluster, system string) []time.Duration {
	conv := func(i int) []message {
		return []message{{"system", system}, {"user", fmt.Sprintf("What happened on market day number %d?", i)}}
	}
	first := request(b.Context(), client, c.Nodes[0], conv(0), sharedTokens, true, time.Minute, nil, "")
	if first.Kind != "ok" {
		b.Fatalf("the first conversation: %s: %s", first.Kind, first.Error)
	}
	out := []time.Duration{first.TTFT}
	time.Sleep(sharedPause) // the pattern's pause, not a synchronization
	var mu sync.Mutex
	var wg sync.WaitGroup
	for i := 1; i < sharedConversations; i++ {
		wg.Go(func() {
			r := request(b.Context(), client, c.Nodes[i%len(c.Nodes)], conv(i), sharedTokens, true, time.Minute, nil, "")
			if r.Kind != "ok" {
				b.Errorf("conversation %d: %s: %s", i, r.Kind, r.Error)
				return
			}
			mu.Lock()
			out = append(out, r.TTFT)
			mu.Unlock()
		})
		time.Sleep(sharedEvery)
	}
	wg.Wait()
	return out
}

// tokenCount is text's tokens on n's model (POST /tokenize).
func tokenCount(b *testing.B, n *Node, text string) int {
	body, _ := json.Marshal(map[string]any{"content": text})
	resp, err := client.Post(n.URL()+"/tokenize", "application/json", bytes.NewReader(body))
	if err != nil {
		b.Fatal(err)
	}
	defer resp.Body.Close()
	var r struct {
		Count int `json:"count"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&r); err != nil {
		b.Fatal(err)
	}
	return r.Count
}

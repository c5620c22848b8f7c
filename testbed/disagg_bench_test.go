package testbed

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// BenchmarkDisagg: streams decoding steadily beside bursts of long new prompts, on two
// nodes pinned to a core each (so that one machine of two cores stands for two
// machines): co-located (both nodes of role both: each owns half the conversations and
// prefills its own) against split (a decode node owning every conversation and a prefill
// node prefilling their prompts), on the same two cores. Reported: the decoding streams'
// inter-token p50 and p99, the bursts' time to first token (p50, p99), and the prompts
// prefilled elsewhere. The model is INFERNODE_BENCH_MODEL (make bench-disagg);
// INFERNODE_DISAGG_STREAMS (4), INFERNODE_DISAGG_PROMPT (words of a burst's prompt,
// 1,200: about 1,500 tokens), INFERNODE_DISAGG_SECONDS (48) and INFERNODE_DISAGG_EVERY
// (seconds between bursts, 8) shape the load.
func BenchmarkDisagg(b *testing.B) {
	model := os.Getenv("INFERNODE_BENCH_MODEL")
	if model == "" {
		b.Skip("INFERNODE_BENCH_MODEL not set; run make bench-disagg")
	}
	env := func(name string, def int) int {
		if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
			return v
		}
		return def
	}
	streams, words := env("INFERNODE_DISAGG_STREAMS", 4), env("INFERNODE_DISAGG_PROMPT", 1200)
	length := time.Duration(env("INFERNODE_DISAGG_SECONDS", 48)) * time.Second
	every := time.Duration(env("INFERNODE_DISAGG_EVERY", 8)) * time.Second
	for _, mode := range []string{"colocated", "split"} {
		b.Run(mode, func(b *testing.B) {
			var gaps, ttft []time.Duration
			var remote float64
			for b.Loop() {
				first, second := []string{}, []string{}
				if mode == "split" {
					first, second = []string{"--role", "decode"}, []string{"--role", "prefill"}
				}
				c, err := Start(b.Context(), Config{Binary: binary, Model: model, Nodes: 1, LogDir: b.TempDir(), Pin: true,
					Args: append([]string{"--threads", "1", "--ctx", "32768", "--sequences", "8", "--replicas", "0", "--log-level", "info"}, first...)})
				if err != nil {
					b.Fatal(err)
				}
				other, err := c.Add(b.Context(), "node2", second...)
				if err != nil {
					c.Close()
					b.Fatal(err)
				}
				if mode == "split" {
					waitPrefiller(b, c, c.Nodes[0], other)
				} else if _, err := c.WaitRings(b.Context(), c.IDs(), 30*time.Second); err != nil {
					c.Close()
					b.Fatal(err)
				}
				entries := c.Nodes // clients enter at the nodes that decode: a prefill node is not an entry
				if mode == "split" {
					entries = c.Nodes[:1]
				}
				g, t := disaggLoad(b, c, entries, streams, words, length, every)
				gaps, ttft = append(gaps, g...), append(ttft, t...)
				for _, n := range c.Nodes {
					v, _ := c.Metric(n, `infernode_remote_prefills_total{outcome="ok"}`)
					remote += v
				}
				c.Close()
			}
			if len(gaps) == 0 {
				b.Fatal("no inter-token gap measured")
			}
			slices.Sort(gaps)
			slices.Sort(ttft)
			ms := func(d []time.Duration, p float64) float64 {
				return float64(d[min(len(d)-1, int(float64(len(d))*p))].Microseconds()) / 1000
			}
			b.ReportMetric(ms(gaps, 0.5), "itl-p50-ms")
			b.ReportMetric(ms(gaps, 0.99), "itl-p99-ms")
			if len(ttft) > 0 {
				b.ReportMetric(ms(ttft, 0.5), "burst-ttft-p50-ms")
				b.ReportMetric(ms(ttft, 0.99), "burst-ttft-p99-ms")
			}
			b.ReportMetric(float64(len(ttft)), "bursts")
			b.ReportMetric(remote, "prefilled-elsewhere")
			b.ReportMetric(0, "ns/op")
		})
	}
}

// disaggLoad runs streams greedy streaming chats back to back (each turn a new
// conversation: short prompts, long answers) entering at alternate entries for length,
// and every interval a new conversation with a prompt of words distinct words (nothing
// cached or shared) answering one token; it returns the streams' gaps between tokens
// (from the first token on) and the bursts' times to their answer.
func disaggLoad(b *testing.B, c *Cluster, entries []*Node, streams, words int, length, every time.Duration) (gaps, ttft []time.Duration) {
	ctx, cancel := context.WithTimeout(b.Context(), length)
	defer cancel()
	var mu sync.Mutex
	var wg sync.WaitGroup
	for s := range streams {
		wg.Go(func() {
			for turn := 0; ctx.Err() == nil; turn++ {
				g := streamGaps(ctx, entries[(s+turn)%len(entries)], fmt.Sprintf("Tell story %d, part %d, about a river.", s, turn), 160)
				mu.Lock()
				gaps = append(gaps, g...)
				mu.Unlock()
			}
		})
	}
	vocab := strings.Fields("river stone bridge garden quiet morning light forest path old village market bread window candle winter harbor ship sail wind")
	tick := time.NewTicker(every)
	defer tick.Stop()
	for i := 0; ; i++ {
		select {
		case <-ctx.Done():
			wg.Wait()
			return gaps, ttft
		case <-tick.C:
		}
		wg.Go(func() {
			var sb strings.Builder
			fmt.Fprintf(&sb, "Document %d of %d.", i, time.Now().UnixNano())
			for w := range words {
				sb.WriteString(" " + vocab[(w*7+i*13+w*w)%len(vocab)])
			}
			start := time.Now()
			a := chatVia(b, patient, entries[i%len(entries)].URL(), map[string]any{"messages": []message{{"user", sb.String()}}, "max_tokens": 1, "temperature": 0})
			if a.status == 200 {
				mu.Lock()
				ttft = append(ttft, time.Since(start))
				mu.Unlock()
			}
		})
	}
}

// streamGaps streams a greedy chat answer and returns the gaps between its content
// events after the first.
func streamGaps(ctx context.Context, n *Node, prompt string, maxTokens int) []time.Duration {
	body, _ := json.Marshal(map[string]any{"messages": []message{{"user", prompt}}, "max_tokens": maxTokens, "temperature": 0, "stream": true})
	req, _ := http.NewRequestWithContext(ctx, "POST", n.URL()+"/v1/chat/completions", bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return nil
	}
	defer resp.Body.Close()
	var gaps []time.Duration
	var last time.Time
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "data: {") || !strings.Contains(line, `"content"`) {
			continue
		}
		now := time.Now()
		if !last.IsZero() {
			gaps = append(gaps, now.Sub(last))
		}
		last = now
	}
	return gaps
}

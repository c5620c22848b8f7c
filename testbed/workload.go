package testbed

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"
)

type message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// Workload is a bounded load of multi-turn conversations.
type Workload struct {
	Conversations int           // conversations to run, at most
	Turns         int           // turns each
	Concurrency   int           // conversations in flight
	Duration      time.Duration // no conversation starts after this
	MaxTokens     int           // tokens a turn
	StreamShare   float64       // fraction of turns streamed
	Timeout       time.Duration // a request still open after this is counted as hung
	Seed          uint64        // seeds entry-node choice and streaming; logged in the report
	// HonorRetry makes a client refused with Retry-After wait that long before its next
	// request, as OpenAI's client libraries do.
	HonorRetry bool
	// Interleave is how many conversations each client keeps open, sending their turns in
	// turn (a user with several chats, or a server with many users): more conversations
	// straddle each fault than clients run at once. 0 or 1: one at a time.
	Interleave int
	// First is the first conversation's number (each number is its own conversation).
	First int
}

// Record is one request as the client saw it.
type Record struct {
	Conv      int           `json:"conv"`
	Turn      int           `json:"turn"`
	Entry     string        `json:"entry"`
	Served    string        `json:"served,omitempty"`
	Stream    bool          `json:"stream"`
	MaxTokens int           `json:"max_tokens"`
	Status    int           `json:"status"`
	Kind      string        `json:"kind"` // ok, http_error, sse_error, conn_error, cut, bad_event, hung
	Error     string        `json:"error,omitempty"`
	Code      string        `json:"code,omitempty"`        // the OpenAI error code of an http_error
	Retry     bool          `json:"retry_after,omitempty"` // the refusal carried Retry-After
	wait      time.Duration // what Retry-After said
	Hops      int           `json:"hops"` // forwards behind the answer; -1 when not reported
	Start     time.Time     `json:"start"`
	End       time.Time     `json:"end"`
	TTFT      time.Duration `json:"ttft_ns"`
	Tokens    int           `json:"tokens"`
	Cached    int           `json:"cached_tokens"`       // prompt tokens the serving node found in its KV cache
	Source    string        `json:"kv_source,omitempty"` // how they came there: replica, handoff, push, pull (empty: a turn ran there)
	Resumed   bool          `json:"resumed"`
	Seams     []int         `json:"seams,omitempty"` // byte offsets in Text where the answer resumed elsewhere
	Text      string        `json:"text,omitempty"`
	Messages  []message     `json:"messages,omitempty"`
}

// flight counts the forwarded streams in flight by the node serving them, so faults can
// aim at the owner of live streams that can resume elsewhere.
type flight struct {
	mu     sync.Mutex
	byNode map[string]int
}

func (f *flight) add(node string, d int) {
	if f == nil || node == "" {
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.byNode[node] += d
}

// busiest is the node serving the most streams now, among candidates, and how many.
func (f *flight) busiest(candidates []string) (string, int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	best, n := "", 0
	for _, id := range candidates {
		if f.byNode[id] > n {
			best, n = id, f.byNode[id]
		}
	}
	return best, n
}

// RunWorkload drives w against the cluster. Each request enters on a random node among
// those entries returns at that moment.
func (c *Cluster) RunWorkload(ctx context.Context, w Workload, entries func() []*Node) []Record {
	var mu sync.Mutex
	var out []Record
	if c.flight == nil {
		c.flight = &flight{byNode: map[string]int{}}
	}
	start := time.Now()
	next := 0
	var wg sync.WaitGroup
	client := &http.Client{Timeout: w.Timeout}
	for worker := range w.Concurrency {
		rng := rand.New(rand.NewPCG(w.Seed, uint64(worker)))
		wg.Go(func() {
			type conversation struct {
				id, turn int
				msgs     []message
			}
			var open []*conversation // round robin: the next turn is the first's
			for ctx.Err() == nil {
				for len(open) < max(1, w.Interleave) {
					mu.Lock()
					id := next
					next++
					mu.Unlock()
					if id >= w.Conversations || time.Since(start) > w.Duration {
						break
					}
					id += w.First
					open = append(open, &conversation{id: id, msgs: []message{{"system", fmt.Sprintf("you are story %d", id)}, {"user", "begin"}}})
				}
				if len(open) == 0 {
					return
				}
				cv := open[0]
				open = open[1:]
				nodes := entries()
				if len(nodes) == 0 {
					return
				}
				entry := nodes[rng.IntN(len(nodes))]
				r := request(ctx, client, entry, cv.msgs, w.MaxTokens, rng.Float64() < w.StreamShare, w.Timeout, c.flight, "")
				r.Conv, r.Turn, r.Messages = cv.id, cv.turn, cv.msgs
				mu.Lock()
				out = append(out, r)
				mu.Unlock()
				if r.Kind != "ok" { // the conversation ends here
					if w.HonorRetry && r.wait > 0 {
						select {
						case <-ctx.Done():
						case <-time.After(min(r.wait, time.Until(start.Add(w.Duration)))):
						}
					}
					continue
				}
				cv.msgs = append(cv.msgs[:len(cv.msgs):len(cv.msgs)], message{"assistant", r.Text}, message{"user", fmt.Sprint("go on ", cv.turn)})
				if cv.turn++; cv.turn < w.Turns {
					open = append(open, cv)
				}
			}
		})
	}
	wg.Wait()
	return out
}

// request sends one greedy chat completion and classifies how it ended. A streamed answer
// counts in fl while it is read. session, when not empty, names the conversation (the
// ring's key) instead of its opening.
func request(ctx context.Context, client *http.Client, entry *Node, msgs []message, maxTokens int, stream bool, timeout time.Duration,
	fl *flight, session string) (r Record) {
	r = Record{Entry: entry.ID, Stream: stream, MaxTokens: maxTokens, Start: time.Now(), Hops: -1}
	defer func() { r.End = time.Now() }()
	fields := map[string]any{"messages": msgs, "max_tokens": maxTokens, "temperature": 0, "stream": stream,
		"stream_options": streamOptions(stream)}
	if session != "" {
		fields["session_id"] = session
	}
	body, _ := json.Marshal(fields)
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "POST", entry.URL()+"/v1/chat/completions", bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		r.Kind, r.Error = classify(err), err.Error()
		return r
	}
	defer resp.Body.Close()
	r.Status, r.Served = resp.StatusCode, resp.Header.Get("X-Infernode-Node")
	r.Cached, _ = strconv.Atoi(resp.Header.Get("X-Infernode-Cached-Tokens"))
	r.Source = resp.Header.Get("X-Infernode-KV-Source")
	if resp.StatusCode != 200 {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		r.Kind, r.Error = "http_error", strings.TrimSpace(string(b))
		var e struct {
			Error struct {
				Code string `json:"code"`
			} `json:"error"`
		}
		json.Unmarshal(b, &e)
		r.Code, r.Retry = e.Error.Code, resp.Header.Get("Retry-After") != ""
		if secs, err := strconv.Atoi(resp.Header.Get("Retry-After")); err == nil {
			r.wait = time.Duration(secs) * time.Second
		}
		return r
	}
	if !stream {
		var out struct {
			Choices []struct{ Message message }
			Usage   struct {
				CompletionTokens int `json:"completion_tokens"`
			}
		}
		if err := json.NewDecoder(resp.Body).Decode(&out); err != nil || len(out.Choices) == 0 {
			r.Kind, r.Error = classify(err), fmt.Sprint("bad body: ", err)
			return r
		}
		r.Text, r.Tokens, r.TTFT = out.Choices[0].Message.Content, out.Usage.CompletionTokens, time.Since(r.Start)
		r.Resumed = resp.Header.Get("X-Infernode-Resumed") != ""
		if h, err := strconv.Atoi(resp.Header.Get("X-Infernode-Hops")); err == nil {
			r.Hops = h
		}
		r.Kind = "ok"
		return r
	}
	// Forwarded: a fault on its owner can resume it elsewhere. It counts as in flight
	// until half its tokens are in: an answer may end early (an end-of-text token), and one
	// near its end may be wholly written by the owner, in transit, when the fault lands,
	// leaving nothing to resume.
	counted := r.Served != entry.ID
	uncount := func() {
		if counted {
			fl.add(r.Served, -1)
			counted = false
		}
	}
	if counted {
		fl.add(r.Served, 1)
		defer uncount()
	}
	pieces := 0
	var text strings.Builder
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, ": infernode-resumed") {
			r.Resumed = true
			r.Seams = append(r.Seams, text.Len())
			continue
		}
		if h, ok := strings.CutPrefix(line, ": infernode-hops "); ok {
			r.Hops, _ = strconv.Atoi(h)
			continue
		}
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok {
			continue
		}
		if data == "[DONE]" {
			r.Text, r.Kind = text.String(), "ok"
			return r
		}
		var ev struct {
			Choices []struct{ Delta message }
			Usage   *struct {
				CompletionTokens int `json:"completion_tokens"`
			}
			Error *struct{ Message string }
		}
		if err := json.Unmarshal([]byte(data), &ev); err != nil {
			r.Kind, r.Error, r.Text = "bad_event", fmt.Sprintf("unreadable event %q: %v", data, err), text.String()
			return r
		}
		if ev.Error != nil {
			r.Kind, r.Error, r.Text = "sse_error", ev.Error.Message, text.String()
			return r
		}
		if ev.Usage != nil {
			r.Tokens = ev.Usage.CompletionTokens
		}
		if len(ev.Choices) > 0 && ev.Choices[0].Delta.Content != "" {
			if r.TTFT == 0 {
				r.TTFT = time.Since(r.Start)
			}
			text.WriteString(ev.Choices[0].Delta.Content)
			if pieces++; pieces >= maxTokens/2 {
				uncount()
			}
		}
	}
	r.Text = text.String()
	if err := sc.Err(); err != nil {
		r.Kind, r.Error = classify(err), err.Error()
	} else {
		r.Kind, r.Error = "cut", "stream ended without [DONE] or an error event"
	}
	return r
}

func streamOptions(stream bool) any {
	if !stream {
		return nil
	}
	return map[string]bool{"include_usage": true}
}

func classify(err error) string {
	if errors.Is(err, context.DeadlineExceeded) || strings.Contains(fmt.Sprint(err), "Client.Timeout") {
		return "hung"
	}
	return "conn_error"
}

// Metric reads one metric's value (summed over label sets matching prefix) from a node. A
// metric the node does not export is an error, never a zero.
func (c *Cluster) Metric(n *Node, prefix string) (float64, error) {
	req, err := http.NewRequest("GET", n.URL()+"/metrics", nil)
	if err != nil {
		return 0, err
	}
	if c.cfg.APIKey != "" {
		req.Header.Set("Authorization", "Bearer "+c.cfg.APIKey)
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		return 0, fmt.Errorf("%s: /metrics answered %d", n.ID, resp.StatusCode)
	}
	sum, found := 0.0, false
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, prefix) {
			continue
		}
		f := strings.Fields(line)
		v, err := strconv.ParseFloat(f[len(f)-1], 64)
		if err != nil {
			return 0, fmt.Errorf("%s: metric line %q: %w", n.ID, line, err)
		}
		sum, found = sum+v, true
	}
	if !found {
		return 0, fmt.Errorf("%s: no metric %s", n.ID, prefix)
	}
	return sum, sc.Err()
}

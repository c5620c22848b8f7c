package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/infernode/infernode/internal/measure"
)

// TestPlan: the same seed plans the same workload; arrivals come at about the rate asked
// for; lengths stay in their documented bounds; conversations have several turns.
func TestPlan(t *testing.T) {
	a, b := plan(4, 10*time.Minute, 7), plan(4, 10*time.Minute, 7)
	if !slices.EqualFunc(a, b, func(x, y conversation) bool { return x.at == y.at && slices.Equal(x.turns, y.turns) }) {
		t.Fatal("one seed planned two workloads")
	}
	if c := plan(4, 10*time.Minute, 8); c[0].at == a[0].at {
		t.Error("another seed planned the same first arrival")
	}
	requests, multi := 0, 0
	for _, c := range a {
		requests += len(c.turns)
		if len(c.turns) > 1 {
			multi++
		}
		for _, tn := range c.turns {
			if tn.words < 4 || tn.words > 400 || tn.maxTokens < 8 || tn.maxTokens > 256 {
				t.Fatalf("turn %+v out of bounds", tn)
			}
		}
	}
	if rate := float64(requests) / 600; rate < 3.4 || rate > 4.6 {
		t.Errorf("%d requests planned in 10 minutes: %.2f a second, want about 4", requests, rate)
	}
	if multi < len(a)/2 {
		t.Errorf("%d of %d conversations have follow-ups, want most (mean %g turns)", multi, len(a), turnsMean)
	}
}

// TestOpenRun: against a server that answers every token 5 ms apart after a 20 ms first
// token, a run meets a loose SLO and misses a tight one; follow-ups carry their
// conversation's history (growing) and its id in the session header.
func TestOpenRun(t *testing.T) {
	var mu sync.Mutex
	history := map[string][]int{} // session -> messages a request carried
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			Messages  []map[string]string
			MaxTokens int `json:"max_tokens"`
		}
		json.NewDecoder(r.Body).Decode(&req)
		mu.Lock()
		s := r.Header.Get("X-Session-ID")
		history[s] = append(history[s], len(req.Messages))
		mu.Unlock()
		w.Header().Set("Content-Type", "text/event-stream")
		time.Sleep(20 * time.Millisecond)
		n := min(req.MaxTokens, 6)
		for i := range n {
			fmt.Fprintf(w, "data: {\"choices\":[{\"delta\":{\"content\":\" w%d\"}}]}\n\n", i)
			w.(http.Flusher).Flush()
			time.Sleep(5 * time.Millisecond)
		}
		fmt.Fprintf(w, "data: {\"choices\":[],\"usage\":{\"completion_tokens\":%d}}\n\ndata: [DONE]\n\n", n)
	}))
	defer srv.Close()
	tg := target{url: srv.URL, model: "m", sessionHeader: "X-Session-ID"}
	loose, _ := openRun(context.Background(), srv.Client(), tg, 20, 3*time.Second, 1, time.Second, 50*time.Millisecond, nil)
	grew := 0
	for s, counts := range history {
		if s == "" {
			t.Fatal("a request without its session header")
		}
		for i := 1; i < len(counts); i++ {
			if counts[i] != counts[i-1]+2 {
				t.Fatalf("session %s carried %v messages turn by turn, want each follow-up two more", s, counts)
			}
			grew++
		}
	}
	if loose.Requests < 20 || loose.Failed > 0 || loose.Attainment != 1 || loose.Goodput < 6 {
		t.Errorf("loose SLO: %+v", loose)
	}
	if grew == 0 {
		t.Error("no follow-up was sent")
	}
	tight, _ := openRun(context.Background(), srv.Client(), tg, 20, 3*time.Second, 1, 10*time.Millisecond, 50*time.Millisecond, nil)
	// The same workload, give or take a follow-up whose think time ends by the deadline in
	// one run and not in the other.
	if tight.Attainment != 0 || tight.Goodput != 0 || tight.Requests < loose.Requests*9/10 {
		t.Errorf("a 10 ms first-token target against a 20 ms server: %+v (%d requests, %d in the first run)", tight, tight.Requests, loose.Requests)
	}
}

// TestSLOScales: attainment and goodput at multiples of the SLO count the requests
// meeting both targets so multiplied; a failed request meets none, and has no prompt in
// the median.
func TestSLOScales(t *testing.T) {
	at := time.Unix(0, 0)
	req := func(ttft, tpot time.Duration) result {
		return result{start: at, first: at.Add(ttft), end: at.Add(ttft + 4*tpot), tokens: 5, promptTokens: int(ttft / time.Millisecond)}
	}
	rs := []result{
		req(15*time.Millisecond, 5*time.Millisecond), // meets 2x and 4x
		req(30*time.Millisecond, 5*time.Millisecond), // meets 4x
		req(5*time.Millisecond, 30*time.Millisecond), // its time per token meets 4x only
		req(60*time.Millisecond, 5*time.Millisecond), // meets none
		{start: at, err: fmt.Errorf("refused")},      // failed
	}
	l := summarizeOpen(1, rs, 10*time.Second, 10*time.Millisecond, 10*time.Millisecond, []float64{2, 4})
	want := []measure.Scaled{{Scale: 2, Attainment: 0.2, Goodput: 0.1}, {Scale: 4, Attainment: 0.6, Goodput: 0.3}}
	if l.Attainment != 0 || l.Goodput != 0 || !slices.Equal(l.Scaled, want) || l.Failed != 1 {
		t.Errorf("got attainment %v goodput %v scaled %+v failed %d; want 0, 0, %+v, 1", l.Attainment, l.Goodput, l.Scaled, l.Failed, want)
	}
	if l.PromptP50 != 30 { // the upper middle of 5, 15, 30, 60 (the failed request's not counted)
		t.Errorf("median prompt %d tokens, want 30", l.PromptP50)
	}
	if l.Answered != 5+15+30+60+4*5 {
		t.Errorf("%d tokens answered, want the prompts and completions of the four that did not fail, 130", l.Answered)
	}
}

// TestFollowUps: the follow-up percentiles and cached share count only second and later
// turns that succeeded; resumes are summed over every request; a server that reports no
// cached tokens gets -1, not 0.
func TestFollowUps(t *testing.T) {
	at := time.Unix(0, 0)
	req := func(turn int, ttft time.Duration, prompt, cached, resumed int) result {
		return result{start: at, first: at.Add(ttft), end: at.Add(ttft), tokens: 1, turn: turn,
			promptTokens: prompt, cachedTokens: cached, cacheReported: true, resumed: resumed}
	}
	rs := []result{
		req(0, 500*time.Millisecond, 50, 0, 0),
		req(1, 20*time.Millisecond, 100, 90, 1),
		req(2, 40*time.Millisecond, 200, 150, 0),
		{start: at, turn: 1, err: fmt.Errorf("refused"), resumed: 1},
	}
	l := summarizeOpen(1, rs, time.Second, time.Second, time.Second, nil)
	if l.FollowTTFTp99ms != 40 || l.FollowTTFTp50ms > 40 || l.FollowTTFTp50ms < 20 {
		t.Errorf("follow-up TTFT p50 %v p99 %v ms, want within 20-40 and 40", l.FollowTTFTp50ms, l.FollowTTFTp99ms)
	}
	if l.FollowCached != 0.8 || l.Resumed != 2 {
		t.Errorf("follow-ups cached %v, resumed %d; want 0.8, 2", l.FollowCached, l.Resumed)
	}
	for i := range rs {
		rs[i].cacheReported = false
	}
	if l := summarizeOpen(1, rs, time.Second, time.Second, time.Second, nil); l.FollowCached != -1 {
		t.Errorf("follow-ups cached %v from a server that reports none, want -1", l.FollowCached)
	}
}

// TestStreamRecords: a stream reports the proxy's backend, the serving node, infernode's
// resume comments and the cached prompt tokens; one that ends before [DONE] failed.
func TestStreamRecords(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Upstream", "127.0.0.1:9")
		w.Header().Set("X-Infernode-Node", "node2")
		fmt.Fprint(w, "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n: infernode-resumed 1\n\n")
		fmt.Fprint(w, "data: {\"choices\":[],\"usage\":{\"completion_tokens\":1,\"prompt_tokens\":9,\"prompt_tokens_details\":{\"cached_tokens\":7}}}\n\n")
		if r.Header.Get("X-Session-ID") != "cut" {
			fmt.Fprint(w, "data: [DONE]\n\n")
		}
	}))
	defer srv.Close()
	tg := target{url: srv.URL, model: "m", sessionHeader: "X-Session-ID"}
	msgs := []map[string]string{{"role": "user", "content": "hi"}}
	r := tg.stream(srv.Client(), msgs, "whole", 4, 1)
	q := r.record()
	if q.Error != "" || q.Upstream != "127.0.0.1:9" || q.Node != "node2" || q.Resumed != 1 || q.CachedTokens != 7 || q.PromptTokens != 9 {
		t.Errorf("record %+v", q)
	}
	if r := tg.stream(srv.Client(), msgs, "cut", 4, 1); r.err == nil {
		t.Error("a stream without [DONE] did not fail")
	}
}

// TestEndWait: the time from an answer's last token to its stream's end counts in its time
// per output token but in no inter-token gap, and is reported apart.
func TestEndWait(t *testing.T) {
	at := time.Unix(0, 0)
	ms := func(n int) time.Time { return at.Add(time.Duration(n) * time.Millisecond) }
	rs := []result{
		{start: at, first: ms(10), events: []time.Time{ms(10), ms(20), ms(30)}, gaps: []time.Duration{10 * time.Millisecond, 10 * time.Millisecond}, end: ms(230), tokens: 3},
		{start: at, first: ms(10), events: []time.Time{ms(10), ms(20), ms(30)}, gaps: []time.Duration{10 * time.Millisecond, 10 * time.Millisecond}, end: ms(31), tokens: 3},
	}
	rs = append(rs, rs[1])
	l := summarizeOpen(1, rs, time.Second, time.Second, time.Second, nil)
	if l.ITLp50ms != 10 || l.EndWaitp50ms != 1 || l.EndWaitp99ms != 200 || l.TPOTp99ms != 110 {
		t.Errorf("ITL p50 %v, end wait p50/p99 %v/%v, TPOT p99 %v; want 10, 1/200, 110", l.ITLp50ms, l.EndWaitp50ms, l.EndWaitp99ms, l.TPOTp99ms)
	}
}

// TestPlanScalesWithRate: a higher rate plans the lower rate's conversations, the same
// turns at times scaled by the ratio of the rates, and more after them; their words differ.
func TestPlanScalesWithRate(t *testing.T) {
	lo, hi := plan(0.5, time.Minute, 1), plan(1, time.Minute, 1)
	if len(hi) <= len(lo) || len(lo) == 0 {
		t.Fatalf("%d conversations at 1 a second, %d at 0.5: want more at the higher rate", len(hi), len(lo))
	}
	for i, c := range lo {
		h := hi[i]
		if !slices.Equal(c.turns, h.turns) {
			t.Fatalf("conversation %d: turns %v at 0.5, %v at 1", i, c.turns, h.turns)
		}
		if d := c.at - 2*h.at; d < -time.Microsecond || d > time.Microsecond {
			t.Fatalf("conversation %d starts at %v at 0.5 and %v at 1, want half", i, c.at, h.at)
		}
	}
	if a, b := message(messageRNG(1, 0.5, 0), 20), message(messageRNG(1, 1, 0), 20); a == b {
		t.Errorf("rates 0.5 and 1 send the same first message %q", a)
	}
	if a, b := message(messageRNG(1, 1, 0), 20), message(messageRNG(2, 1, 0), 20); a == b {
		t.Errorf("seeds 1 and 2 send the same first message %q", a)
	}
}

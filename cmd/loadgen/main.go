// Command loadgen measures an OpenAI-compatible server (infernode or any other) by URL:
// rounds of N concurrent streaming chat completions, reporting aggregate decode
// throughput and time-to-first-token and inter-token latency percentiles.
//
//	loadgen --url http://127.0.0.1:8080 --concurrency 1,4,8 --rounds 5 --max-tokens 64
//	loadgen --url http://127.0.0.1:8080 --rate 1,2,4 --duration 60s --slo-ttft 1s --slo-tpot 100ms
//
// The second form is open-loop (see open.go): requests arrive at Poisson times from a
// seeded, synthesized multi-turn workload, whatever the server's latency, and each rate
// reports the share of requests meeting both latency targets and the goodput.
//
// Decode throughput is measured as in the session engine's BenchmarkDecode, so the two can
// be compared: in steady state, counting text events (one a token while the client keeps
// up) that arrive while every request of the round is decoding, from the last first-token
// to the first finish, over that window's length. Requests that arrive a little apart and
// prefill at different times therefore do not count against the server.
package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/infernode/infernode/internal/measure"
)

type result struct {
	start, first, end time.Time
	tokens            int
	promptTokens      int    // as the server counted them
	cachedTokens      int    // of them, those the server reported it had cached
	cacheReported     bool   // whether it reported them at all (ollama does not)
	resumed           int    // times the server resumed the stream elsewhere (infernode's SSE comment)
	upstream          string // the X-Upstream header (a proxy's backend, as nginx's $upstream_addr)
	node              string // the X-Infernode-Node header
	conversation      string
	turn              int // 0: the conversation's first
	text              string
	events            []time.Time // arrival of each text event
	gaps              []time.Duration
	err               error
}

// target is the server and how every request asks it.
type target struct {
	url, key, model string
	temperature     float64
	sessionHeader   string // if set, each conversation's id goes in this header
}

func main() {
	url := flag.String("url", "http://127.0.0.1:8080", "base URL of the server (without /v1)")
	model := flag.String("model", "", "model id (default: the first of GET /v1/models)")
	apiKey := flag.String("api-key", os.Getenv("OPENAI_API_KEY"), "bearer token, if the server wants one")
	levels := flag.String("concurrency", "1,4,8", "comma-separated concurrent streams per round")
	rounds := flag.Int("rounds", 5, "rounds per concurrency level")
	maxTokens := flag.Int("max-tokens", 64, "tokens to generate per request")
	promptWords := flag.Int("prompt-words", 16, "words in each request's user message")
	temperature := flag.Float64("temperature", 0.8, "sampling temperature (0: greedy)")
	asJSON := flag.Bool("json", false, "print JSON instead of a table")
	rates := flag.String("rate", "", "open loop: comma-separated request rates (a second) to run in turn, instead of --concurrency")
	duration := flag.Duration("duration", time.Minute, "open loop: how long each rate runs")
	seed := flag.Uint64("seed", 1, "open loop: the workload's seed (the same seed, the same requests at the same times)")
	sloTTFT := flag.Duration("slo-ttft", time.Second, "open loop: the first-token target")
	sloTPOT := flag.Duration("slo-tpot", 100*time.Millisecond, "open loop: the target time per output token after the first")
	sessionHeader := flag.String("session-header", "X-Session-ID", "open loop: the header carrying each conversation's id (empty: none)")
	records := flag.String("records", "", "open loop: write every request (conversation, turn, start, first token, tokens, cached tokens, X-Upstream, error) to this file, a JSON object a line")
	sloScales := flag.String("slo-scales", "", "open loop: comma-separated factors to measure attainment and goodput at besides the SLO (2: both targets doubled)")
	flag.Parse()

	client := &http.Client{Timeout: 10 * time.Minute}
	if *model == "" {
		m, err := firstModel(client, *url, *apiKey)
		if err != nil {
			fmt.Fprintf(os.Stderr, "loadgen: %v\n", err)
			os.Exit(1)
		}
		*model = m
	}
	t := target{url: *url, key: *apiKey, model: *model, temperature: *temperature, sessionHeader: *sessionHeader}
	if *rates != "" {
		var scales []float64
		for f := range strings.SplitSeq(*sloScales, ",") {
			if f = strings.TrimSpace(f); f == "" {
				continue
			}
			sc, err := strconv.ParseFloat(f, 64)
			if err != nil || sc <= 0 {
				fmt.Fprintf(os.Stderr, "loadgen: bad SLO scale %q\n", f)
				os.Exit(2)
			}
			scales = append(scales, sc)
		}
		var out []measure.OpenLevel
		var all []result
		for _, f := range strings.Split(*rates, ",") {
			r, err := strconv.ParseFloat(strings.TrimSpace(f), 64)
			if err != nil || r <= 0 {
				fmt.Fprintf(os.Stderr, "loadgen: bad rate %q\n", f)
				os.Exit(2)
			}
			l, rs := openRun(context.Background(), client, t, r, *duration, *seed, *sloTTFT, *sloTPOT, scales)
			out, all = append(out, l), append(all, rs...)
		}
		if *records != "" {
			if err := writeRecords(*records, all); err != nil {
				fmt.Fprintf(os.Stderr, "loadgen: %v\n", err)
				os.Exit(1)
			}
		}
		if *asJSON {
			json.NewEncoder(os.Stdout).Encode(out)
			return
		}
		fmt.Printf("SLO: first token within %v, then %v a token; seed %d, %v a rate\n", *sloTTFT, *sloTPOT, *seed, *duration)
		fmt.Printf("%-8s %8s %8s %7s %10s %10s %16s %16s %10s %10s %10s %8s\n", "rate", "achieved", "requests", "failed", "TTFT p50", "TTFT p99",
			"follow-up p50", "follow-up p99", "TPOT p50", "TPOT p99", "attained", "goodput")
		for _, l := range out {
			fmt.Printf("%-8g %8.2f %8d %7d %8.1fms %8.1fms %14.1fms %14.1fms %8.2fms %8.2fms %9.0f%% %8.2f", l.Rate, l.Achieved, l.Requests, l.Failed,
				l.TTFTp50ms, l.TTFTp99ms, l.FollowTTFTp50ms, l.FollowTTFTp99ms, l.TPOTp50ms, l.TPOTp99ms, 100*l.Attainment, l.Goodput)
			for _, sc := range l.Scaled {
				fmt.Printf("   at %gx: %.0f%%, %.2f", sc.Scale, 100*sc.Attainment, sc.Goodput)
			}
			fmt.Println()
		}
		return
	}
	var out []measure.Level
	for _, f := range strings.Split(*levels, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 {
			fmt.Fprintf(os.Stderr, "loadgen: bad concurrency %q\n", f)
			os.Exit(2)
		}
		var all []result
		var decodeTok, decodeSec float64
		for r := range *rounds {
			res := round(client, t, n, r, *maxTokens, *promptWords)
			all = append(all, res...)
			var events [][]time.Time
			for _, x := range res {
				events = append(events, x.events)
			}
			t, s := measure.SteadyRate(events)
			decodeTok += t
			decodeSec += s
		}
		var decode float64
		if decodeSec > 0 { // none when each request is one token
			decode = decodeTok / decodeSec
		}
		out = append(out, summarize(n, all, decode))
	}
	if *asJSON {
		json.NewEncoder(os.Stdout).Encode(out)
		return
	}
	fmt.Printf("%-12s %8s %7s %12s %10s %10s %10s %10s\n", "concurrency", "requests", "failed", "decode tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99")
	for _, l := range out {
		fmt.Printf("%-12d %8d %7d %12.1f %8.1fms %8.1fms %8.2fms %8.2fms\n", l.Concurrency, l.Requests, l.Failed,
			l.DecodeTokS, l.TTFTp50ms, l.TTFTp99ms, l.ITLp50ms, l.ITLp99ms)
	}
}

// writeRecords writes rs to path, a JSON object a line.
func writeRecords(path string, rs []result) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	w := bufio.NewWriter(f)
	enc := json.NewEncoder(w)
	for _, r := range rs {
		if err := enc.Encode(r.record()); err != nil {
			f.Close()
			return err
		}
	}
	if err := w.Flush(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

func firstModel(client *http.Client, url, key string) (string, error) {
	req, _ := http.NewRequest("GET", url+"/v1/models", nil)
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	resp, err := client.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	var list struct{ Data []struct{ ID string } }
	if err := json.NewDecoder(resp.Body).Decode(&list); err != nil || len(list.Data) == 0 {
		return "", fmt.Errorf("GET /v1/models: no model listed (status %d)", resp.StatusCode)
	}
	return list.Data[0].ID, nil
}

// round runs n requests at once, each its own conversation.
func round(client *http.Client, t target, n, r, maxTokens, words int) []result {
	out := make([]result, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			prompt := fmt.Sprintf("round %d request %d: %s", r, i, strings.Repeat("tell me about the river ", max(1, words/5)))
			out[i] = t.stream(client, []map[string]string{{"role": "user", "content": prompt}}, "", maxTokens, int64(r*1000+i))
		})
	}
	wg.Wait()
	return out
}

// stream sends one streaming chat completion of messages and records its events; session,
// if set, goes in the target's session header.
func (t target) stream(client *http.Client, messages []map[string]string, session string, maxTokens int, seed int64) result {
	body, _ := json.Marshal(map[string]any{
		"model": t.model, "messages": messages,
		"max_tokens": maxTokens, "stream": true, "seed": seed, "temperature": t.temperature,
		"stream_options": map[string]bool{"include_usage": true},
	})
	res := result{start: time.Now()}
	req, _ := http.NewRequest("POST", t.url+"/v1/chat/completions", bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	if t.key != "" {
		req.Header.Set("Authorization", "Bearer "+t.key)
	}
	if session != "" && t.sessionHeader != "" {
		req.Header.Set(t.sessionHeader, session)
	}
	resp, err := client.Do(req)
	if err != nil {
		res.err = err
		return res
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		res.err = fmt.Errorf("status %d", resp.StatusCode)
		return res
	}
	res.upstream, res.node = resp.Header.Get("X-Upstream"), resp.Header.Get("X-Infernode-Node")
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	var last time.Time
	var text strings.Builder
	done, lastLine := false, ""
	for sc.Scan() {
		if sc.Text() != "" {
			lastLine = sc.Text()
		}
		if strings.HasPrefix(sc.Text(), ": infernode-resumed ") {
			res.resumed++
			continue
		}
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if data == "[DONE]" {
			done = true
		}
		if !ok || data == "[DONE]" {
			continue
		}
		var chunk struct {
			Choices []struct{ Delta struct{ Content string } }
			Usage   *struct {
				PromptTokens        int `json:"prompt_tokens"`
				CompletionTokens    int `json:"completion_tokens"`
				PromptTokensDetails *struct {
					CachedTokens int `json:"cached_tokens"`
				} `json:"prompt_tokens_details"`
			}
			Error *struct{ Message string }
		}
		if err := json.Unmarshal([]byte(data), &chunk); err != nil {
			res.err = err
			return res
		}
		if chunk.Error != nil {
			res.err = fmt.Errorf("stream error: %s", chunk.Error.Message)
			return res
		}
		if chunk.Usage != nil {
			res.tokens, res.promptTokens = chunk.Usage.CompletionTokens, chunk.Usage.PromptTokens
			if d := chunk.Usage.PromptTokensDetails; d != nil {
				res.cachedTokens, res.cacheReported = d.CachedTokens, true
			}
		}
		if len(chunk.Choices) > 0 && chunk.Choices[0].Delta.Content != "" {
			text.WriteString(chunk.Choices[0].Delta.Content)
			now := time.Now()
			res.events = append(res.events, now)
			if res.first.IsZero() {
				res.first = now
			} else {
				res.gaps = append(res.gaps, now.Sub(last))
			}
			last = now
		}
	}
	res.end, res.text = time.Now(), text.String()
	if res.err = sc.Err(); res.err == nil && !done {
		// A server or proxy that died mid-answer, or a server that ended it another way.
		res.err = fmt.Errorf("the stream ended before [DONE] (%d bytes of text; its last line %.300q)", text.Len(), lastLine)
	}
	return res
}

func summarize(n int, rs []result, decode float64) measure.Level {
	l := measure.Level{Concurrency: n, Requests: len(rs), DecodeTokS: decode}
	var ttft, gaps []time.Duration
	var first, last time.Time
	for _, r := range rs {
		if r.err != nil {
			l.Failed++
			fmt.Fprintf(os.Stderr, "loadgen: request failed: %v\n", r.err)
			continue
		}
		ttft = append(ttft, r.first.Sub(r.start))
		gaps = append(gaps, r.gaps...)
		l.TotalTokens += r.tokens
		if first.IsZero() || r.start.Before(first) {
			first = r.start
		}
		if r.end.After(last) {
			last = r.end
		}
	}
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
	l.TTFTp50ms, l.TTFTp99ms = ms(measure.Percentile(ttft, 50)), ms(measure.Percentile(ttft, 99))
	l.ITLp50ms, l.ITLp99ms = ms(measure.Percentile(gaps, 50)), ms(measure.Percentile(gaps, 99))
	l.WallSeconds = last.Sub(first).Seconds()
	return l
}

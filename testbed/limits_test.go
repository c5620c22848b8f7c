package testbed

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/infernode/infernode/internal/testenv"
)

// TestRateLimitClusterWide: one tenant driven at three times its limit through all three
// nodes gets its limit cluster-wide (a third of what it sends, not all of it), the rest
// 429 with OpenAI's body and headers; another tenant is not held by it. Halfway, a node
// is killed and the client goes on through the other two: the limit holds, give or take
// a burst (the bucket's owner may be the node killed: its heir's bucket starts full).
func TestRateLimitClusterWide(t *testing.T) {
	dir := t.TempDir()
	keys, limits := filepath.Join(dir, "keys"), filepath.Join(dir, "limits")
	os.WriteFile(keys, []byte("key-of-tenant-a-0001 alpha\nkey-of-tenant-b-0002 beta\n"), 0o600)
	os.WriteFile(limits, []byte("alpha rpm=240\n"), 0o600) // 4 a second, a burst of 12
	c := launch(t, Config{Model: testenv.Model(t), Nodes: 3, APIKey: "default-key-0123456789",
		Args: []string{"--ctx", "8192", "--key-file", keys, "--limits", limits}})
	if _, err := c.WaitRings(t.Context(), c.IDs(), 30*time.Second); err != nil {
		t.Fatal(err)
	}

	const rate = 12 // requests a second: three times the limit
	duration := 15 * time.Second
	if s, err := strconv.Atoi(os.Getenv("INFERNODE_LIMIT_SECONDS")); err == nil && s > 0 {
		duration = time.Duration(s) * time.Second // a longer run, for docs/BENCHMARKS.md
	}
	var mu sync.Mutex
	counts := map[string]map[int]int{"alpha": {}, "beta": {}}
	var headers []string
	var wg sync.WaitGroup
	start := time.Now()
	nodes := c.Nodes
	for i := 0; time.Since(start) < duration; i++ {
		if len(nodes) == 3 && time.Since(start) > duration/2 {
			c.Nodes[2].Kill()
			nodes = c.Nodes[:2]
		}
		node := nodes[i%len(nodes)]
		for tenant, key := range map[string]string{"alpha": "key-of-tenant-a-0001", "beta": "key-of-tenant-b-0002"} {
			if tenant == "beta" && i%4 != 0 {
				continue // beta sends less, without a limit
			}
			wg.Go(func() {
				req, _ := newPost(node.URL()+"/v1/completions", `{"prompt":"Once","max_tokens":1}`, key)
				resp, err := client.Do(req)
				if err != nil {
					return // sent to the node as it was killed
				}
				resp.Body.Close()
				mu.Lock()
				defer mu.Unlock()
				counts[tenant][resp.StatusCode]++
				if resp.StatusCode == 429 && headers == nil {
					for _, h := range []string{"Retry-After", "Retry-After-Ms", "X-Ratelimit-Limit-Requests", "X-Ratelimit-Remaining-Requests", "X-Ratelimit-Reset-Requests"} {
						headers = append(headers, h+"="+resp.Header.Get(h))
					}
				}
			})
		}
		time.Sleep(time.Second / rate)
	}
	wg.Wait()
	took := time.Since(start).Seconds()
	limit := 4 * took
	got := float64(counts["alpha"][200])
	t.Logf("alpha: %d admitted, %d refused in %.1fs (limit %.0f, burst 12); beta: %v; a 429's headers: %v",
		counts["alpha"][200], counts["alpha"][429], took, limit, counts["beta"], headers)
	if most := 1.1 * (limit + 2*12); got < 0.9*limit || got > most {
		t.Errorf("alpha got %v through three nodes, want %.0f to %.0f (its limit and two bursts), not three times it", got, 0.9*limit, most)
	}
	if counts["alpha"][429] == 0 || counts["beta"][429] > 0 || counts["beta"][200] == 0 {
		t.Errorf("alpha refused %d, beta refused %d of %d", counts["alpha"][429], counts["beta"][429], counts["beta"][200])
	}
	for _, h := range headers {
		if strings.HasSuffix(h, "=") {
			t.Errorf("a 429 without %s", h)
		}
	}
}

// newPost is a JSON POST to url with API key key.
func newPost(url, body, key string) (*http.Request, error) {
	req, err := http.NewRequest("POST", url, strings.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+key)
	return req, nil
}

// TestPreemptFlex: on a node of two sequences, a flex (batch) completion streams; an
// interactive one takes the free sequence and a second finds none: the flex one is
// preempted (its KV copied out of llama.cpp's cache) rather than make it wait, resumes
// when both are done, and its text is the one it gives alone (on a real pretrained model,
// llama2.c's reference continuation first). The metrics count the preemption.
func TestPreemptFlex(t *testing.T) {
	c := launch(t, Config{Model: testenv.SharedModel(t, "stories260K.gguf"), Nodes: 1, Args: []string{"--sequences", "2"}})
	if _, err := c.WaitRings(t.Context(), c.IDs(), 30*time.Second); err != nil {
		t.Fatal(err)
	}
	url := c.Nodes[0].URL()
	flex := map[string]any{"prompt": "Once upon a time", "max_tokens": 300, "temperature": 0, "service_tier": "flex"}
	want, err := streamCompletion(url, flex, nil)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(want, testenv.Stories260KOnceUponATime) {
		t.Fatalf("alone: %q, want llama2.c's reference %q first", want, testenv.Stories260KOnceUponATime)
	}
	var wg sync.WaitGroup
	texts, errs := make([]string, 3), make([]error, 3)
	for i, req := range []map[string]any{flex,
		{"prompt": "One day, a little bird", "max_tokens": 1000, "temperature": 0},
		{"prompt": "The little dog", "max_tokens": 1000, "temperature": 0}} {
		first := make(chan struct{})
		wg.Go(func() { texts[i], errs[i] = streamCompletion(url, req, first) })
		select { // the next starts once this one streams
		case <-first:
		case <-t.Context().Done():
			t.Fatal("no first token")
		}
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
	}
	if !strings.Contains(metrics(t, c.Nodes[0]), "infernode_preemptions_total 1\n") {
		t.Errorf("no preemption counted (did the flex answer end before the interactive ones came?)")
	}
	if texts[0] != want {
		t.Errorf("preempted: %q\nalone: %q", texts[0], want)
	}
}

// streamCompletion streams a text completion and returns its text; first, when not nil,
// is closed at its first text.
func streamCompletion(url string, req map[string]any, first chan struct{}) (string, error) {
	req["stream"] = true
	body, _ := json.Marshal(req)
	resp, err := client.Post(url+"/v1/completions", "application/json", strings.NewReader(string(body)))
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		return "", fmt.Errorf("status %d", resp.StatusCode)
	}
	var text strings.Builder
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if data == "[DONE]" {
			return text.String(), nil
		}
		var ev struct {
			Choices []struct{ Text string }
			Error   *struct{ Message string }
		}
		if err := json.Unmarshal([]byte(data), &ev); err != nil {
			return text.String(), err
		}
		if ev.Error != nil {
			return text.String(), fmt.Errorf("error event: %s", ev.Error.Message)
		}
		if len(ev.Choices) > 0 && ev.Choices[0].Text != "" {
			text.WriteString(ev.Choices[0].Text)
			if first != nil {
				close(first)
				first = nil
			}
		}
	}
	return text.String(), fmt.Errorf("the stream ended before [DONE]: %v", sc.Err())
}

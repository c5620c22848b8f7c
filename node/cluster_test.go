package node

import (
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/infernode/infernode/session"
)

// TestHopAuthentication: with a cluster secret, only requests signed with it are served
// as forwarded ones; a forged hop is refused and changes nothing.
func TestHopAuthentication(t *testing.T) {
	nodes := startFakeCluster(t, 2, "s3cret")
	body, _ := json.Marshal(session.Request{SessionID: "k", Prompt: "hello", MaxTokens: 1, Sampling: session.Greedy()})
	post := func(sig string) (int, string) {
		req, _ := http.NewRequest("POST", nodes[1].url+internalPath, strings.NewReader(string(body)))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set(hopHeader, "n1")
		if sig != "" {
			req.Header.Set(signatureHeader, sig)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if status, _ := post(""); status != 401 {
		t.Errorf("unsigned hop: status %d, want 401", status)
	}
	if status, _ := post(strings.Repeat("ab", 32)); status != 401 {
		t.Errorf("forged signature: status %d, want 401", status)
	}
	status, out := post(nodes[0].cluster.sign(body))
	if status != 200 || !strings.Contains(out, `"done"`) {
		t.Errorf("signed hop: status %d body %q, want a served answer", status, out)
	}
	// Through the front door, the entry node signs its own forwards.
	req, _ := http.NewRequest("POST", nodes[0].url+"/v1/completions", strings.NewReader(`{"prompt":"hello","max_tokens":1}`))
	req.Header.Set("Content-Type", "application/json")
	for _, key := range ownedBy(nodes[0].cluster, "n2", 1) {
		req.Header.Set("X-Session-ID", key)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 || resp.Header.Get(nodeHeader) != "n2" {
		t.Errorf("forwarded request: status %d served by %q, want 200 from n2", resp.StatusCode, resp.Header.Get(nodeHeader))
	}
}

// TestNotReady: before the model is loaded, /readyz says why and generation is refused
// with 503 and Retry-After.
func TestNotReady(t *testing.T) {
	srvURL := startUnloaded(t)
	resp, err := http.Get(srvURL + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 503 || !strings.Contains(string(b), "model loading") {
		t.Errorf("/readyz while loading: %d %s", resp.StatusCode, b)
	}
	resp, err = http.Post(srvURL+"/v1/completions", "application/json", strings.NewReader(`{"prompt":"hi"}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 503 || resp.Header.Get("Retry-After") == "" {
		t.Errorf("completion while loading: %d, Retry-After %q", resp.StatusCode, resp.Header.Get("Retry-After"))
	}
}

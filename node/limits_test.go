package node

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// startTenants starts a standalone node on engine whose clients are two tenants, alpha
// (key-of-tenant-a-0001) and beta (key-of-tenant-b-0002), held to the limits file text
// limits, and returns its URL.
func startTenants(t *testing.T, engine *fakeEngine, limits string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "limits")
	if err := os.WriteFile(path, []byte(limits), 0o600); err != nil {
		t.Fatal(err)
	}
	keys := writeKeys(t, "key-of-tenant-a-0001 alpha\nkey-of-tenant-b-0002 beta\n")
	url, _ := startStandalone(t, engine, func(c *Config) { c.KeyFile, c.LimitsFile = keys, path })
	return url
}

// TestRateLimitAnswers: a limited tenant's answers carry OpenAI's x-ratelimit headers;
// past its burst it gets a 429 in OpenAI's shape with retry-after and retry-after-ms; a
// tenant without limits carries none.
func TestRateLimitAnswers(t *testing.T) {
	url := startTenants(t, &fakeEngine{n: 1}, "alpha rpm=60 tpm=600 burst=3\n") // 3 requests, 30 tokens at once
	alpha := []string{"Authorization", "Bearer key-of-tenant-a-0001"}
	var statuses []int
	var last map[string]string
	var body []byte
	for range 4 {
		resp := postJSON(t, url+"/v1/completions", `{"prompt":"hi","max_tokens":2}`, alpha...)
		body, _ = io.ReadAll(resp.Body)
		resp.Body.Close()
		statuses = append(statuses, resp.StatusCode)
		last = map[string]string{}
		for _, h := range []string{"x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests",
			"x-ratelimit-limit-tokens", "retry-after", "retry-after-ms"} {
			last[h] = resp.Header.Get(h)
		}
		if resp.StatusCode == 200 && (last["x-ratelimit-limit-requests"] != "60" || last["x-ratelimit-limit-tokens"] != "600" ||
			last["x-ratelimit-reset-requests"] == "") {
			t.Errorf("an admitted answer's headers: %v", last)
		}
	}
	if statuses[0] != 200 || statuses[3] != 429 {
		t.Fatalf("statuses %v: want 200 first and 429 past the burst of 3", statuses)
	}
	var e struct {
		Error struct{ Type, Code string }
	}
	json.Unmarshal(body, &e)
	ms, _ := strconv.Atoi(last["retry-after-ms"])
	if e.Error.Code != "rate_limit_exceeded" || e.Error.Type != "requests" || last["retry-after"] == "" || ms <= 0 || ms > 1000 {
		t.Errorf("the 429: %s, headers %v", body, last)
	}
	resp := postJSON(t, url+"/v1/completions", `{"prompt":"hi","max_tokens":2}`, "Authorization", "Bearer key-of-tenant-b-0002")
	resp.Body.Close()
	if resp.StatusCode != 200 || resp.Header.Get("x-ratelimit-limit-requests") != "" {
		t.Errorf("a tenant without limits: %d, %q", resp.StatusCode, resp.Header.Get("x-ratelimit-limit-requests"))
	}
}

// TestBatchPriority: service_tier "flex" makes a request batch work, and so does its
// tenant's priority=batch whatever it asks; an unknown tier is refused.
func TestBatchPriority(t *testing.T) {
	engine := &fakeEngine{n: 1}
	url := startTenants(t, engine, "beta priority=batch\n")
	for _, tc := range []struct {
		key, body string
		status    int
		batch     bool
	}{
		{"key-of-tenant-a-0001", `{"prompt":"hi"}`, 200, false},
		{"key-of-tenant-a-0001", `{"prompt":"hi","service_tier":"flex"}`, 200, true},
		{"key-of-tenant-a-0001", `{"prompt":"hi","service_tier":"priority"}`, 200, false},
		{"key-of-tenant-b-0002", `{"prompt":"hi","service_tier":"priority"}`, 200, true},
		{"key-of-tenant-a-0001", `{"prompt":"hi","service_tier":"gold"}`, 400, false},
	} {
		engine.last.Store(nil)
		resp := postJSON(t, url+"/v1/completions", tc.body, "Authorization", "Bearer "+tc.key)
		resp.Body.Close()
		last := engine.last.Load()
		if resp.StatusCode != tc.status || (last != nil && last.Batch != tc.batch) {
			t.Errorf("%s %s: %d, batch %v; want %d, %v", tc.key, tc.body, resp.StatusCode, last != nil && last.Batch, tc.status, tc.batch)
		}
	}
}

// TestResponseCacheOptIn: a greedy request is answered from the response cache when it
// asks (response_cache) or its tenant's limits say response_cache=on, and computed every
// time otherwise; the cached answer's usage says so.
func TestResponseCacheOptIn(t *testing.T) {
	engine := &fakeEngine{n: 3}
	url := startTenants(t, engine, "beta response_cache=on\n")
	for _, tc := range []struct {
		key, body string
		computed  int64 // of two asks
	}{
		{"key-of-tenant-a-0001", `{"prompt":"hi","temperature":0}`, 2},
		{"key-of-tenant-a-0001", `{"prompt":"hi there","temperature":0,"response_cache":true}`, 1},
		{"key-of-tenant-a-0001", `{"prompt":"hi you","temperature":0.5,"response_cache":true}`, 2},
		{"key-of-tenant-b-0002", `{"prompt":"hi","temperature":0}`, 1},
	} {
		before := engine.served.Load()
		var usage []string
		for range 2 {
			resp := postJSON(t, url+"/v1/completions", tc.body, "Authorization", "Bearer "+tc.key)
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 {
				t.Fatalf("%s: %d %s", tc.body, resp.StatusCode, b)
			}
			usage = append(usage, fmt.Sprint(strings.Contains(string(b), `"response_cached":true`)))
		}
		if got := engine.served.Load() - before; got != tc.computed {
			t.Errorf("%s %s: computed %d of 2 asks, want %d", tc.key, tc.body, got, tc.computed)
		}
		if want := fmt.Sprint(tc.computed == 1); usage[1] != want || usage[0] != "false" {
			t.Errorf("%s %s: usage says cached %v", tc.key, tc.body, usage)
		}
	}
}

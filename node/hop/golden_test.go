package hop

import (
	"encoding/hex"
	"encoding/json"
	"testing"

	"github.com/infernode/infernode/session/infer"
)

// Golden bytes of the hop: what peers exchange, written down before any move of the code
// that makes them, so that a refactoring that changes one byte fails here. A wanted change
// of the wire comes with a version bump and a new golden value, never silently.

func TestGoldenHopRequest(t *testing.T) {
	req := infer.Request{SessionID: "s1", FollowUp: true, Prompt: "hi", MaxTokens: 7, Stop: []string{"\n"},
		Messages: []infer.Message{{Role: "user", Content: "x"}}, Logprobs: true, TopLogprobs: 2,
		Sampling: infer.Sampling{Temperature: 0.5, TopK: 4, TopP: 0.9, MinP: 0.1, RepeatPenalty: 1.1, PresencePenalty: 0.2,
			FrequencyPenalty: 0.3, RepeatLastN: 64, Seed: 42}}
	b, err := json.Marshal(NewRequest("m", req))
	if err != nil {
		t.Fatal(err)
	}
	const want = `{"model":"m","session_id":"s1","follow_up":true,"prompt":"hi","messages":[{"role":"user","content":"x"}],"max_tokens":7,"stop":["\n"],"temperature":0.5,"top_k":4,"top_p":0.9,"min_p":0.1,"repeat_penalty":1.1,"presence_penalty":0.2,"frequency_penalty":0.3,"repeat_last_n":64,"seed":42,"logprobs":true,"top_logprobs":2}`
	if string(b) != want {
		t.Errorf("hop request body:\n got %s\nwant %s", b, want)
	}
	var back Request
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	if got, _ := json.Marshal(back); string(got) != want {
		t.Errorf("decoded and encoded again:\n got %s\nwant %s", got, want)
	}
	// Since 1.4: a sharing domain, only when the request has one.
	const shared = `{"model":"m","session_id":"","share":"t:a:00","prompt":"p","temperature":0,"top_p":0,"seed":0}`
	if b, _ := json.Marshal(NewRequest("m", infer.Request{Prompt: "p", Share: "t:a:00"})); string(b) != shared {
		t.Errorf("hop request with a sharing domain:\n got %s\nwant %s", b, shared)
	}
	const minimal = `{"model":"m","session_id":"","prompt":"p","temperature":0,"top_p":0,"seed":0}`
	if b, _ := json.Marshal(NewRequest("m", infer.Request{Prompt: "p"})); string(b) != minimal {
		t.Errorf("minimal hop request body:\n got %s\nwant %s", b, minimal)
	}
}

func TestGoldenHopSignature(t *testing.T) {
	var sum Sum
	copy(sum.Hash[:], "0123456789abcdef0123456789abcdef")
	sign := func() string {
		return hex.EncodeToString(mac([]byte("key of the cluster"), "POST", Path, "node1", "node2", "1.3", "1800000000000",
			"00112233445566778899aabbccddeeff", sum))
	}
	// The same value as HMAC-SHA256 over the parts, each ending in "\n", computed outside Go;
	// the last part is the body's SHA-256 in hex, or since 1.9 "blake3:" and its BLAKE3.
	if got, want := sign(), "05ee449dd887bb557e0fe3903b017c7c70325a7f0f862c3334025f7676c9f888"; got != want {
		t.Errorf("signature: got %s, want %s", got, want)
	}
	sum.BLAKE3 = true
	if got, want := sign(), "addccfb667c91866a58eb78b25e8b6ef96e31f25adbcd0015963833cf98fae6a"; got != want {
		t.Errorf("signature over a BLAKE3: got %s, want %s", got, want)
	}
}

func TestGoldenHopEvents(t *testing.T) {
	for _, c := range []struct {
		ev   Event
		want string
	}{
		{Event{}, `{}`},
		{Event{Text: "a", Tokens: 1, Prompt: 5, Cached: 2, Formatted: "<p>"}, `{"t":"a","n":1,"p":5,"c":2,"f":"\u003cp\u003e"}`},
		{Event{Text: " b", Tokens: 2}, `{"t":" b","n":2}`},
		{Event{Done: &Done{FinishReason: "stop", PromptTokens: 5, CachedTokens: 2, CompletionTokens: 3,
			Logprobs: []infer.TokenLogprob{{Token: "a", Logprob: -0.5, Top: []infer.TopLogprob{{Token: "a", Logprob: -0.5}}}}}},
			`{"done":{"finish_reason":"stop","prompt_tokens":5,"cached_tokens":2,"completion_tokens":3,"logprobs":[{"token":"a","logprob":-0.5,"top":[{"token":"a","logprob":-0.5}]}]}}`},
		{Event{Error: &Error{Status: 503, Message: "busy", Type: "server_error", Code: "overloaded", RetryAfter: 2}},
			`{"error":{"status":503,"message":"busy","type":"server_error","param":null,"code":"overloaded","retry_after":2}}`},
		{Event{Error: &Error{Status: 400, Message: "bad", Type: "invalid_request_error", Param: "messages"}},
			`{"error":{"status":400,"message":"bad","type":"invalid_request_error","param":"messages","code":null}}`},
	} {
		b, err := json.Marshal(c.ev)
		if err != nil {
			t.Fatal(err)
		}
		if string(b) != c.want {
			t.Errorf("event:\n got %s\nwant %s", b, c.want)
		}
		var back Event
		if err := json.Unmarshal([]byte(c.want), &back); err != nil {
			t.Fatal(err)
		}
		if b, _ := json.Marshal(back); string(b) != c.want {
			t.Errorf("event decoded and encoded again:\n got %s\nwant %s", b, c.want)
		}
	}
}

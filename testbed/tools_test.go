package testbed

import (
	"bufio"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/infernode/infernode/internal/testenv"
)

const weatherParams = `{"type":"object","properties":{"city":{"type":"string","maxLength":20},"unit":{"enum":["celsius","fahrenheit"]}},"required":["city","unit"],"additionalProperties":false}`

// weatherTools is a tools list of two functions.
func weatherTools() []any {
	return []any{
		map[string]any{"type": "function", "function": map[string]any{"name": "get_weather", "description": "The weather in a city.",
			"parameters": json.RawMessage(weatherParams)}},
		map[string]any{"type": "function", "function": map[string]any{"name": "get_time", "description": "The time now."}},
	}
}

type toolCallOut struct {
	Index    *int   `json:"index"`
	ID       string `json:"id"`
	Type     string `json:"type"`
	Function struct {
		Name      string `json:"name"`
		Arguments string `json:"arguments"`
	} `json:"function"`
}

// TestToolCalls, on real processes and a real model: a forced call (tool_choice naming a
// function) comes back in OpenAI's shape with arguments that validate against the
// function's parameters; the call and its result sent back as the next turn land on the
// same owner, warm; the same call streamed arrives as tool-call deltas (an index on every
// one, the id and name in the first, the arguments in pieces that join to JSON).
func TestToolCalls(t *testing.T) {
	model := testenv.SharedModel(t, "stories260K.gguf")
	c := launch(t, Config{Model: model, Nodes: 3, Args: []string{"--ctx", "8192"}})
	if _, err := c.WaitRings(t.Context(), c.IDs(), 30*time.Second); err != nil {
		t.Fatal(err)
	}
	msgs := []any{map[string]any{"role": "user", "content": "What is the weather in Paris?"}}
	named := map[string]any{"type": "function", "function": map[string]any{"name": "get_weather"}}
	first := chatWith(t, c.Nodes[0].URL(), map[string]any{"messages": msgs, "tools": weatherTools(), "tool_choice": named,
		"max_tokens": 100, "temperature": 0})
	var out struct {
		Choices []struct {
			Message struct {
				Content   *string       `json:"content"`
				ToolCalls []toolCallOut `json:"tool_calls"`
			} `json:"message"`
			FinishReason string `json:"finish_reason"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(first.body, &out); err != nil || first.status != 200 || len(out.Choices) != 1 {
		t.Fatalf("status %d: %s", first.status, first.body)
	}
	ch := out.Choices[0]
	if ch.FinishReason != "tool_calls" || ch.Message.Content != nil || len(ch.Message.ToolCalls) != 1 {
		t.Fatalf("want one tool call and finish_reason tool_calls: %s", first.body)
	}
	call := ch.Message.ToolCalls[0]
	if call.Type != "function" || call.Function.Name != "get_weather" || !strings.HasPrefix(call.ID, "call_") {
		t.Errorf("call %+v", call)
	}
	testenv.ValidJSON(t, weatherParams, call.Function.Arguments)
	t.Logf("on %s: %s(%s)", first.node, call.Function.Name, call.Function.Arguments)

	next := append(msgs,
		map[string]any{"role": "assistant", "content": nil, "tool_calls": []any{call}},
		map[string]any{"role": "tool", "tool_call_id": call.ID, "content": "sunny, 21 degrees"})
	second := chatWith(t, c.Nodes[2].URL(), map[string]any{"messages": next, "tools": weatherTools(), "parallel_tool_calls": false,
		"max_tokens": 200, "temperature": 0})
	if second.status != 200 || second.node != first.node || second.cached == 0 {
		t.Errorf("the turn with the result: status %d on %s with %d cached tokens; want 200 on %s, warm: %s",
			second.status, second.node, second.cached, first.node, second.body)
	}
	t.Logf("next turn on %s, %d of %d prompt tokens cached: %s", second.node, second.cached, second.prompt, second.body)

	// Streamed.
	body, _ := json.Marshal(map[string]any{"messages": msgs, "tools": weatherTools(), "tool_choice": "required", "parallel_tool_calls": false,
		"max_tokens": 100, "temperature": 0, "stream": true})
	resp, err := client.Post(c.Nodes[1].URL()+"/v1/chat/completions", "application/json", strings.NewReader(string(body)))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var deltas []toolCallOut
	finish := ""
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		var ev struct {
			Choices []struct {
				Delta struct {
					ToolCalls []toolCallOut `json:"tool_calls"`
				} `json:"delta"`
				FinishReason *string `json:"finish_reason"`
			} `json:"choices"`
		}
		if err := json.Unmarshal([]byte(data), &ev); err != nil || len(ev.Choices) != 1 {
			t.Fatalf("event %s: %v", data, err)
		}
		deltas = append(deltas, ev.Choices[0].Delta.ToolCalls...)
		if f := ev.Choices[0].FinishReason; f != nil {
			finish = *f
		}
	}
	if finish != "tool_calls" || len(deltas) < 2 {
		t.Fatalf("streamed: finish %q, %d tool-call deltas", finish, len(deltas))
	}
	args := map[int]string{}
	for i, d := range deltas {
		switch {
		case d.Index == nil:
			t.Errorf("delta %d has no index", i)
		case d.ID != "" && (d.Function.Name == "" || d.Type != "function"):
			t.Errorf("delta %d: id without name and type: %+v", i, d)
		case d.ID == "" && (d.Function.Name != "" || args[*d.Index] == "" && i > 0 && deltas[i-1].Index != nil && *deltas[i-1].Index != *d.Index):
			t.Errorf("delta %d: a call's first delta without its id: %+v", i, d)
		}
		if d.Index != nil {
			args[*d.Index] += d.Function.Arguments
		}
	}
	if deltas[0].ID == "" {
		t.Errorf("the first delta has no id: %+v", deltas[0])
	}
	for i, a := range args {
		if !json.Valid([]byte(a)) {
			t.Errorf("call %d: arguments joined to %q, not JSON", i, a)
		}
	}
	t.Logf("streamed: %d deltas, arguments %v", len(deltas), args)
}

// TestTokenizer, on a real binary and a real model: /tokenize counts a prompt's tokens as
// the engine does (with the BOS, as many as a completion of it reports), /detokenize reads
// them back, and bad input is refused.
func TestTokenizer(t *testing.T) {
	model := testenv.SharedModel(t, "stories260K.gguf")
	c := launch(t, Config{Model: model, Nodes: 1, Args: []string{"--ctx", "8192"}})
	if _, err := c.WaitRings(t.Context(), c.IDs(), 30*time.Second); err != nil {
		t.Fatal(err)
	}
	url := c.Nodes[0].URL()
	post := func(path string, req any) (int, map[string]any) {
		body, _ := json.Marshal(req)
		resp, err := client.Post(url+path, "application/json", strings.NewReader(string(body)))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var out map[string]any
		json.NewDecoder(resp.Body).Decode(&out)
		return resp.StatusCode, out
	}
	const text = "Once upon a time, there was a little girl"
	status, tok := post("/tokenize", map[string]any{"content": text, "add_special": true})
	if status != 200 {
		t.Fatalf("tokenize: %d %v", status, tok)
	}
	var ids []int
	for _, v := range tok["tokens"].([]any) {
		ids = append(ids, int(v.(float64)))
	}
	body, _ := json.Marshal(map[string]any{"prompt": text, "max_tokens": 1, "temperature": 0})
	resp, err := client.Post(url+"/v1/completions", "application/json", strings.NewReader(string(body)))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if got := resp.Header.Get("X-Infernode-Prompt-Tokens"); got != fmt.Sprint(len(ids)) || tok["count"] != float64(len(ids)) {
		t.Errorf("tokenize counted %d tokens (count %v), a completion of the same prompt %s", len(ids), tok["count"], got)
	}
	status, detok := post("/detokenize", map[string]any{"tokens": ids[1:]}) // without the BOS
	if status != 200 || strings.TrimSpace(detok["content"].(string)) != text {
		t.Errorf("detokenize: %d %q, want %q", status, detok["content"], text)
	}
	for _, bad := range []struct {
		path string
		req  any
	}{
		{"/detokenize", map[string]any{"tokens": []int{1, 1 << 30}}},
		{"/tokenize", map[string]any{"add_special": true}},
		{"/tokenize", map[string]any{"model": "another", "content": "x"}},
		{"/tokenize", map[string]any{"content": "x", "surprise": 1}},
	} {
		if status, out := post(bad.path, bad.req); status != 400 {
			t.Errorf("%s %v: %d %v, want 400", bad.path, bad.req, status, out)
		}
	}
}

package node

import (
	"bufio"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
)

// TestResponseIDs: an id carries its conversation's key back to the principal that made
// it, and to no one else; a changed byte, or another cluster's key, reads as nothing.
func TestResponseIDs(t *testing.T) {
	m := newIDMinter([]byte("cluster one's id key, 32 bytes.."))
	alice, bob := principal("k", "alice"), principal("k", "bob")
	for _, key := range []string{"h:" + alice + ":9f3a", "s:" + alice + ":my session: with colons", "r:" + alice + ":x"} {
		id := m.mint("resp", key)
		prefix, got, ok := m.read(id, alice)
		if !ok || prefix != "resp" || got != key {
			t.Fatalf("read(mint(%q)) = %q, %q, %v", key, prefix, got, ok)
		}
		if _, _, ok := m.read(id, bob); ok {
			t.Errorf("another principal read %q", id)
		}
		if _, _, ok := newIDMinter([]byte("cluster two's id key, 32 bytes..")).read(id, alice); ok {
			t.Errorf("another cluster read %q", id)
		}
		b := []byte(id)
		b[len(b)/2] ^= 1
		if _, _, ok := m.read(string(b), alice); ok {
			t.Errorf("a changed id %q was read", b)
		}
		if m.mint("resp", key) == id {
			t.Error("two ids alike")
		}
	}
	for _, junk := range []string{"", "resp_", "resp_!!", "nounderscore", "resp_" + strings.Repeat("A", 2000)} {
		if _, _, ok := m.read(junk, alice); ok {
			t.Errorf("junk %q was read", junk)
		}
	}
}

func respond(t *testing.T, url, body string, header ...string) (int, map[string]any) {
	t.Helper()
	resp := postJSON(t, url+"/v1/responses", body, header...)
	defer resp.Body.Close()
	var out map[string]any
	b, _ := io.ReadAll(resp.Body)
	if err := json.Unmarshal(b, &out); err != nil {
		t.Fatalf("%d %s: %v", resp.StatusCode, b, err)
	}
	return resp.StatusCode, out
}

func getResponse(t *testing.T, method, url, id string, header ...string) int {
	req, _ := http.NewRequest(method, url+"/v1/responses/"+id, nil)
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

func outputText(o map[string]any) string {
	var sb strings.Builder
	for _, it := range o["output"].([]any) {
		item := it.(map[string]any)
		if item["type"] != "message" {
			continue
		}
		for _, p := range item["content"].([]any) {
			sb.WriteString(p.(map[string]any)["text"].(string))
		}
	}
	return sb.String()
}

func errorParam(o map[string]any) string {
	e, _ := o["error"].(map[string]any)
	p, _ := e["param"].(string)
	return p
}

// TestResponsesChain: a chain of responses by previous_response_id continues one
// conversation (its key, its history, not its instructions); item references bring back
// the items they name; GET and DELETE find a stored response, store: false keeps none,
// and another tenant finds nothing of it.
func TestResponsesChain(t *testing.T) {
	engine := &fakeEngine{n: 2}
	path := writeKeys(t, "key-of-tenant-a-0001 alpha\nkey-of-tenant-b-0002 beta\n")
	url, _ := startStandalone(t, engine, func(c *Config) { c.KeyFile = path })
	alpha, beta := []string{"Authorization", "Bearer key-of-tenant-a-0001"}, []string{"Authorization", "Bearer key-of-tenant-b-0002"}

	status, first := respond(t, url, `{"input":"FIRST","instructions":"SYS","max_output_tokens":2}`, alpha...)
	if status != 200 || first["object"] != "response" || outputText(first) != " tok tok" || first["status"] != "incomplete" {
		t.Fatalf("first: %d %v", status, first)
	}
	key := engine.last.Load().SessionID
	id := first["id"].(string)
	status, second := respond(t, url, `{"input":[{"role":"user","content":[{"type":"input_text","text":"SECOND"}]}],"previous_response_id":"`+id+`"}`, alpha...)
	if status != 200 || second["previous_response_id"] != id {
		t.Fatalf("second: %d %v", status, second)
	}
	last := engine.last.Load()
	if last.SessionID != key || !last.FollowUp || last.Prompt != "FIRST tok tokSECOND" {
		t.Errorf("second turn: key %q (want %q), follow-up %v, prompt %q (want the first's input and answer, not its instructions)",
			last.SessionID, key, last.FollowUp, last.Prompt)
	}
	// The first answer's message, by reference.
	msgID := first["output"].([]any)[0].(map[string]any)["id"].(string)
	status, third := respond(t, url, `{"input":[{"role":"user","content":"FIRST"},{"type":"item_reference","id":"`+msgID+`"},{"role":"user","content":"THIRD"}]}`, alpha...)
	if last := engine.last.Load(); status != 200 || last.SessionID != key || last.Prompt != "FIRST tok tokTHIRD" {
		t.Errorf("item_reference: %d %v, key %q, prompt %q", status, third, last.SessionID, last.Prompt)
	}

	for _, tc := range []struct {
		name   string
		method string
		header []string
		want   int
	}{
		{"GET by its tenant", "GET", alpha, 200},
		{"GET by another tenant", "GET", beta, 404},
		{"DELETE by another tenant", "DELETE", beta, 404},
		{"DELETE", "DELETE", alpha, 200},
		{"GET after DELETE", "GET", alpha, 404},
		{"DELETE twice", "DELETE", alpha, 404},
	} {
		if got := getResponse(t, tc.method, url, id, tc.header...); got != tc.want {
			t.Errorf("%s: %d, want %d", tc.name, got, tc.want)
		}
	}
	status, e := respond(t, url, `{"input":"x","previous_response_id":"`+second["id"].(string)+`"}`, beta...)
	if status != 404 || errorParam(e) != "previous_response_id" {
		t.Errorf("another tenant's previous_response_id: %d %v", status, e)
	}
	status, unstored := respond(t, url, `{"input":"x","store":false}`, alpha...)
	if status != 200 || unstored["store"] != false || getResponse(t, "GET", url, unstored["id"].(string), alpha...) != 404 {
		t.Errorf("store false: %d %v, or it was stored", status, unstored)
	}
}

// TestResponsesRefusals: what infernode does not implement is refused, naming the field;
// what changes nothing is accepted.
func TestResponsesRefusals(t *testing.T) {
	url, _ := startStandalone(t, &fakeEngine{n: 1}, nil)
	for body, param := range map[string]string{
		`{}`:                               "input",
		`{"input":"x","background":true}`:  "background",
		`{"input":"x","top_logprobs":3}`:   "top_logprobs",
		`{"input":"x","no_such":1}`:        "no_such",
		`{"input":"x","conversation":"c"}`: "conversation",
		`{"input":[{"role":"user","content":[{"type":"input_image","image_url":"http://x"}]}]}`:     "input[0].content",
		`{"input":[{"type":"web_search_call"}]}`:                                                    "input[0].type",
		`{"input":"x","tools":[{"type":"web_search"}]}`:                                             "tools[0].type",
		`{"input":"x","text":{"format":{"type":"json_schema","schema":{"not":{"type":"string"}}}}}`: "text.format",
		`{"input":"x","max_output_tokens":0}`:                                                       "max_output_tokens",
		`{"input":"x","previous_response_id":"resp_forged"}`:                                        "previous_response_id",
		`{"input":[{"type":"item_reference","id":"msg_forged"}]}`:                                   "input[0].id",
	} {
		status, e := respond(t, url, body)
		if status/100 != 4 || errorParam(e) != param {
			t.Errorf("%s: %d %v, want a 4xx naming %s", body, status, e, param)
		}
	}
	ignored := `{"input":"x","metadata":{"a":"b"},"include":["message.output_text.logprobs"],"truncation":"auto","user":"u",` +
		`"safety_identifier":"s","service_tier":"auto","reasoning":{"effort":null},"parallel_tool_calls":true,"prompt_cache_key":"p"}`
	if status, o := respond(t, url, ignored); status != 200 {
		t.Errorf("fields that change nothing: %d %v", status, o)
	}
}

// TestResponsesStream: the documented events in order, numbered from 0 without gaps; the
// text deltas make the message's text.
func TestResponsesStream(t *testing.T) {
	url, _ := startStandalone(t, &fakeEngine{n: 3}, nil)
	resp := postJSON(t, url+"/v1/responses", `{"input":"x","stream":true}`)
	defer resp.Body.Close()
	var types []string
	var deltas, done string
	sc := bufio.NewScanner(resp.Body)
	event := ""
	for sc.Scan() {
		line := sc.Text()
		if e, ok := strings.CutPrefix(line, "event: "); ok {
			event = e
			continue
		}
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok {
			continue
		}
		var ev map[string]any
		if err := json.Unmarshal([]byte(data), &ev); err != nil {
			t.Fatal(err)
		}
		if ev["type"] != event || int(ev["sequence_number"].(float64)) != len(types) {
			t.Fatalf("event %d: %s named %q, numbered %v", len(types), data, event, ev["sequence_number"])
		}
		types = append(types, event)
		switch event {
		case "response.output_text.delta":
			deltas += ev["delta"].(string)
		case "response.output_text.done":
			done = ev["text"].(string)
		}
	}
	want := []string{"response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
		"response.output_text.delta", "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
		"response.content_part.done", "response.output_item.done", "response.incomplete"}
	if strings.Join(types, " ") != strings.Join(want, " ") {
		t.Errorf("events\n %v\nwant\n %v", types, want)
	}
	if deltas != " tok tok tok" || done != deltas {
		t.Errorf("deltas %q, done %q", deltas, done)
	}
}

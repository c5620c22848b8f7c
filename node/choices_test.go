package node

import (
	"encoding/json"
	"io"
	"strings"
	"testing"

	"github.com/infernode/infernode/session/infer"
)

// TestPromptList: a completion's prompt is a string, token ids, or a list of either.
func TestPromptList(t *testing.T) {
	for body, want := range map[string]string{
		`"hello"`:             `[{"Text":"hello","Tokens":null}]`,
		`[1,2,3]`:             `[{"Text":"","Tokens":[1,2,3]}]`,
		`["a","b"]`:           `[{"Text":"a","Tokens":null},{"Text":"b","Tokens":null}]`,
		`[[1,2],"b",[3]]`:     `[{"Text":"","Tokens":[1,2]},{"Text":"b","Tokens":null},{"Text":"","Tokens":[3]}]`,
		`[]`:                  "refused",
		`[[]]`:                "refused",
		`{"a":1}`:             "refused",
		`[1.5]`:               "refused",
		`[[1],[2,"x"]]`:       "refused",
		`[99999999999999999]`: "refused",
	} {
		var p promptList
		err := json.Unmarshal([]byte(body), &p)
		got, _ := json.Marshal(p)
		if (err != nil) != (want == "refused") || (err == nil && string(got) != want) {
			t.Errorf("%s: %s, %v; want %s", body, got, err, want)
		}
	}
}

// TestTextLogprobs: OpenAI's legacy shape: a prompt's first token has null, offsets
// follow the tokens' text.
func TestTextLogprobs(t *testing.T) {
	lps := []infer.TokenLogprob{{Token: "A"}, {Token: " b", Logprob: -1, Top: []infer.TopLogprob{{Token: " b", Logprob: -1}}}, {Token: "c", Logprob: -2}}
	b, _ := json.Marshal(textLogprobs(lps, true))
	want := `{"tokens":["A"," b","c"],"token_logprobs":[null,-1,-2],"top_logprobs":[null,{" b":-1},{}],"text_offset":[0,1,3]}`
	if string(b) != want {
		t.Errorf("\n got %s\nwant %s", b, want)
	}
	if b, _ := json.Marshal(textLogprobs(lps[1:], false)); !strings.HasPrefix(string(b), `{"tokens":[" b","c"],"token_logprobs":[-1,-2]`) {
		t.Errorf("generated only: %s", b)
	}
}

// TestManyChoices: a list of prompts and n choices make one answer, a choice a
// generation, indexed prompt by prompt; usage adds theirs up; what the engine is asked is
// each prompt's (token ids as they are), echo and the prompt's logprobs included.
func TestManyChoices(t *testing.T) {
	engine := &fakeEngine{n: 2}
	url, _ := startStandalone(t, engine, nil)
	resp := postJSON(t, url+"/v1/completions", `{"prompt":["one",[5,6,7],"three"],"n":2,"max_tokens":2,"echo":true}`)
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	var out completionObject
	if err := json.Unmarshal(b, &out); err != nil || resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	if len(out.Choices) != 6 || out.Usage.CompletionTokens != 12 || engine.served.Load() != 6 {
		t.Fatalf("%d choices, %d tokens, %d generations; want 6, 12, 6: %s", len(out.Choices), out.Usage.CompletionTokens, engine.served.Load(), b)
	}
	for i, ch := range out.Choices {
		if ch.Index != i || !strings.HasSuffix(*ch.Text, " tok tok") {
			t.Errorf("choice %d: index %d, text %q", i, ch.Index, *ch.Text)
		}
	}
	if *out.Choices[0].Text != "one tok tok" || *out.Choices[5].Text != "three tok tok" {
		t.Errorf("echo: %q, %q", *out.Choices[0].Text, *out.Choices[5].Text)
	}

	resp = postJSON(t, url+"/v1/completions", `{"prompt":[5,6,7],"echo":true,"logprobs":3,"max_tokens":0}`)
	resp.Body.Close()
	if last := engine.last.Load(); resp.StatusCode != 200 || !last.PrefillOnly || !last.PromptLogprobs || last.Logprobs ||
		last.TopLogprobs != 3 || len(last.Tokens) != 3 || last.Tokens[2] != 7 {
		t.Errorf("scoring: %d, engine asked %+v", resp.StatusCode, last)
	}

	for body, param := range map[string]string{
		`{"prompt":"x","max_tokens":0}`:                   "max_tokens",
		`{"prompt":"x","n":2,"stream":true}`:              "n",
		`{"prompt":["x","y"],"stream":true}`:              "prompt",
		`{"prompt":"x","n":17}`:                           "n",
		`{"prompt":"x","logprobs":true,"top_logprobs":2}`: "top_logprobs",
		`{"prompt":"x","logprobs":21}`:                    "logprobs",
		`{"prompt":[""]}`:                                 "prompt",
	} {
		resp := postJSON(t, url+"/v1/completions", body)
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 400 || !strings.Contains(string(b), `"param":"`+param+`"`) {
			t.Errorf("%s: %d %s, want 400 naming %s", body, resp.StatusCode, b, param)
		}
	}
}

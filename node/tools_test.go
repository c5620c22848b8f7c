package node

import (
	"encoding/json"
	"strings"
	"testing"
)

// TestToolPlan: tools and tool_choice become the answer's schema and the system message
// that explains the format; bad tools and choices are refused, naming the field.
func TestToolPlan(t *testing.T) {
	weather := tool{Type: "function"}
	weather.Function.Name, weather.Function.Description = "get_weather", "The weather in a city."
	weather.Function.Parameters = json.RawMessage(`{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}`)
	clock := tool{Type: "function"}
	clock.Function.Name = "get_time"
	for _, tc := range []struct {
		name    string
		p       params
		want    []string // in the schema
		wantNot []string
		text    bool
		refused string
	}{
		{name: "auto", p: params{Tools: []tool{weather, clock}},
			want: []string{`"const":"get_weather"`, `"const":"get_time"`, `"content"`, `"minItems":1`, `"maxItems":16`}, text: true},
		{name: "required, one at a time", p: params{Tools: []tool{weather, clock}, ToolChoice: "required", ParallelToolCalls: new(bool)},
			want: []string{`"const":"get_weather"`, `"maxItems":1}`}, wantNot: []string{`"content"`}},
		{name: "named", p: params{Tools: []tool{weather, clock}, ToolChoice: map[string]any{"type": "function", "function": map[string]any{"name": "get_time"}}},
			want: []string{`"const":"get_time"`, `"maxItems":1}`}, wantNot: []string{`get_weather`, `"content"`}},
		{name: "none", p: params{Tools: []tool{weather}, ToolChoice: "none"}},
		{name: "required without tools", p: params{ToolChoice: "required"}, refused: "tool_choice"},
		{name: "unknown name", p: params{Tools: []tool{weather}, ToolChoice: map[string]any{"type": "function", "function": map[string]any{"name": "fly"}}}, refused: "tool_choice"},
		{name: "bad choice", p: params{Tools: []tool{weather}, ToolChoice: "sometimes"}, refused: "tool_choice"},
		{name: "twice", p: params{Tools: []tool{weather, weather}}, refused: "tools[1].function.name"},
		{name: "unenforced keyword", p: params{Tools: []tool{func() tool {
			x := weather
			x.Function.Parameters = json.RawMessage(`{"type":"object","properties":{"n":{"type":"number","multipleOf":3}}}`)
			return x
		}()}}, refused: "tools[0].function.parameters"},
	} {
		plan, err := tc.p.toolPlan()
		if tc.refused != "" {
			if e, ok := err.(interface{ Body() []byte }); !ok || !strings.Contains(string(e.Body()), `"param":"`+tc.refused+`"`) {
				t.Errorf("%s: %v, want refused on %s", tc.name, err, tc.refused)
			}
			continue
		}
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if tc.name == "none" {
			if plan != nil {
				t.Errorf("none: a plan %+v", plan)
			}
			continue
		}
		if !json.Valid([]byte(plan.schema)) || plan.text != tc.text || !strings.Contains(plan.prompt, "get_") {
			t.Errorf("%s: plan %+v", tc.name, plan)
		}
		var doc any
		json.Unmarshal([]byte(plan.schema), &doc)
		if err := checkSchema(doc, ""); err != nil {
			t.Errorf("%s: the plan's own schema is refused: %v", tc.name, err)
		}
		for _, w := range tc.want {
			if !strings.Contains(plan.schema, w) {
				t.Errorf("%s: schema lacks %s: %s", tc.name, w, plan.schema)
			}
		}
		for _, w := range tc.wantNot {
			if strings.Contains(plan.schema, w) {
				t.Errorf("%s: schema has %s: %s", tc.name, w, plan.schema)
			}
		}
	}
}

// TestToolMessages: a chat with a call and its result renders as the format (the call as
// the JSON the model would have written, the result as a user message naming the call),
// with the format's system message after the chat's own; and an answer in the format reads
// back as calls with ids and their arguments as JSON strings, or as text.
func TestToolMessages(t *testing.T) {
	var chat []chatMessage
	if err := json.Unmarshal([]byte(`[{"role":"system","content":"be brief"},{"role":"user","content":"weather in Paris?"},
		{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"get_weather","arguments":"{\"city\": \"Paris\"}"}}]},
		{"role":"tool","tool_call_id":"call_1","content":"sunny"}]`), &chat); err != nil {
		t.Fatal(err)
	}
	plan := &toolPlan{prompt: "FORMAT", text: true}
	out, err := withTools(chat, plan)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, m := range out {
		got = append(got, m.Role+": "+m.Content.Text)
	}
	want := []string{"system: be brief", "system: FORMAT", "user: weather in Paris?",
		`assistant: {"tool_calls":[{"name":"get_weather","arguments":{"city":"Paris"}}]}`, "user: Result of get_weather (call call_1): sunny"}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("rendered\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	if _, err := withTools(append(chat, chatMessage{Role: "tool", ToolCallID: "call_9"}), plan); err == nil {
		t.Error("a result of a call no message made was taken")
	}

	calls, _, ok := toolAnswer(`{ "tool_calls" : [ { "name" : "get_weather" , "arguments" : { "city" : "Oslo" } } ] }`)
	if !ok || len(calls) != 1 || calls[0].Function.Name != "get_weather" || calls[0].Function.Arguments != `{"city":"Oslo"}` ||
		!strings.HasPrefix(calls[0].ID, "call_") || calls[0].Type != "function" {
		t.Errorf("read back %+v, %v", calls, ok)
	}
	if calls, text, ok := toolAnswer(`{"content": "hello"}`); !ok || calls != nil || text != "hello" {
		t.Errorf("text answer read back as %+v %q %v", calls, text, ok)
	}
	if _, text, ok := toolAnswer(`{"tool_calls": [{"na`); ok || text != `{"tool_calls": [{"na` {
		t.Errorf("a cut answer read back as %q %v", text, ok)
	}
}

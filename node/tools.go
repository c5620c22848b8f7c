package node

import (
	"bytes"
	"cmp"
	"encoding/json"
	"fmt"
	"regexp"
	"strings"
)

// Tool calls. llama.cpp's C API renders a GGUF's chat template without its tool syntax (no
// Jinja engine is compiled in), so infernode uses one generic format for every model, told
// to the model in a system message and enforced by a JSON schema's grammar: the answer is
// one JSON object,
//
//	{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}
//
// to call tools, or, when the model may choose (tool_choice "auto"), {"content": "..."} to
// answer in text. The node turns it back into OpenAI's shape: message.tool_calls (or
// content), finish_reason "tool_calls", and in a stream tool-call deltas with an index, the
// id and name in the first, the arguments after. Each call's arguments match its
// function's parameters, since the grammar is built from them. A model trained on another
// tool format follows this one only as far as the grammar forces it: with "required" or a
// named function it always produces a call whose arguments validate, though what it puts in
// them is as good as its grasp of the system message; with "auto" it may never call.

// tool is one entry of a request's tools.
type tool struct {
	Type     string `json:"type"`
	Function struct {
		Name        string          `json:"name"`
		Description string          `json:"description"`
		Parameters  json.RawMessage `json:"parameters"`
		Strict      *bool           `json:"strict"` // every call is enforced strictly
	} `json:"function"`
}

// toolCall is a call in an assistant message, as OpenAI shapes it.
type toolCall struct {
	Index    *int   `json:"index,omitempty"` // stream deltas only
	ID       string `json:"id,omitempty"`
	Type     string `json:"type,omitempty"`
	Function struct {
		Name      string `json:"name,omitempty"`
		Arguments string `json:"arguments"`
	} `json:"function"`
}

// toolPlan is what a request's tools make of its answer.
type toolPlan struct {
	schema string // the answer's JSON schema
	prompt string // the system message that explains the format
	text   bool   // the model may answer in text ({"content": ...})
}

var toolName = regexp.MustCompile(`^[a-zA-Z0-9_-]{1,64}$`)

// maxParallelCalls bounds the calls of one answer when parallel_tool_calls is on (the
// default): a small model may otherwise add calls until max_tokens.
const maxParallelCalls = 16

// toolPlan checks tools, tool_choice and parallel_tool_calls, and returns nil when no tool
// is in force (none given, or tool_choice "none").
func (p *params) toolPlan() (*toolPlan, error) {
	choice, named, err := toolChoice(p.ToolChoice)
	if err != nil {
		return nil, err
	}
	if len(p.Tools) == 0 {
		if choice == "required" || named != "" {
			return nil, badRequest("tool_choice", "tool_choice %q needs tools", cmp.Or(named, choice))
		}
		return nil, nil
	}
	var calls []string
	var listing strings.Builder
	seen := map[string]bool{}
	for i, t := range p.Tools {
		param := fmt.Sprintf("tools[%d]", i)
		f := t.Function
		switch {
		case t.Type != "function":
			return nil, badRequest(param+".type", "tool type must be \"function\", got %q", t.Type)
		case !toolName.MatchString(f.Name):
			return nil, badRequest(param+".function.name", "a function name is 1 to 64 letters, digits, _ or -, got %q", f.Name)
		case seen[f.Name]:
			return nil, badRequest(param+".function.name", "function %q is listed twice", f.Name)
		}
		seen[f.Name] = true
		params := []byte(`{"type":"object","properties":{},"additionalProperties":false}`) // none: it takes no arguments
		if len(f.Parameters) > 0 && !bytes.Equal(f.Parameters, []byte("null")) {
			var doc any
			if err := json.Unmarshal(f.Parameters, &doc); err != nil {
				return nil, badRequest(param+".function.parameters", "parameters are not JSON: %v", err)
			}
			if err := checkSchema(doc, ""); err != nil {
				return nil, badRequest(param+".function.parameters", "%s parameters %v", f.Name, err)
			}
			var b bytes.Buffer
			json.Compact(&b, f.Parameters)
			params = b.Bytes()
		}
		if named == "" || named == f.Name {
			name, _ := json.Marshal(f.Name)
			calls = append(calls, fmt.Sprintf(`{"type":"object","properties":{"name":{"const":%s},"arguments":%s},"required":["name","arguments"],"additionalProperties":false}`, name, params))
		}
		fmt.Fprintf(&listing, "- %s: %s Arguments (JSON schema): %s\n", f.Name, strings.TrimSpace(f.Description), params)
	}
	if named != "" && len(calls) == 0 {
		return nil, badRequest("tool_choice", "tool_choice names function %q, which tools do not list", named)
	}
	if choice == "none" {
		return nil, nil
	}
	items := calls[0]
	if len(calls) > 1 {
		items = `{"anyOf":[` + strings.Join(calls, ",") + `]}`
	}
	most := fmt.Sprintf(`,"maxItems":%d`, maxParallelCalls)
	if named != "" || (p.ParallelToolCalls != nil && !*p.ParallelToolCalls) {
		most = `,"maxItems":1`
	}
	callSchema := `{"type":"object","properties":{"tool_calls":{"type":"array","items":` + items + `,"minItems":1` + most + `}},"required":["tool_calls"],"additionalProperties":false}`
	plan := &toolPlan{schema: callSchema, text: choice == "auto"}
	var sys strings.Builder
	sys.WriteString("You can call these functions:\n")
	sys.WriteString(listing.String())
	sys.WriteString(`To call functions, answer with one JSON object: {"tool_calls": [{"name": "FUNCTION", "arguments": {...}}]}.`)
	switch {
	case plan.text:
		plan.schema = `{"anyOf":[` + callSchema + `,{"type":"object","properties":{"content":{"type":"string"}},"required":["content"],"additionalProperties":false}]}`
		sys.WriteString(` To answer in text instead, answer with {"content": "TEXT"}.`)
	case named != "":
		fmt.Fprintf(&sys, " Call %s now.", named)
	default:
		sys.WriteString(" Call at least one now.")
	}
	plan.prompt = sys.String()
	return plan, nil
}

// toolChoice reads tool_choice: "none", "auto" (the default), "required", or a named
// function ({"type": "function", "function": {"name": ...}}).
func toolChoice(v any) (choice, named string, err error) {
	switch c := v.(type) {
	case nil:
		return "auto", "", nil
	case string:
		switch c {
		case "none", "auto", "required":
			return c, "", nil
		}
	case map[string]any:
		if fn, ok := c["function"].(map[string]any); ok && c["type"] == "function" {
			if name, ok := fn["name"].(string); ok && name != "" {
				return "required", name, nil
			}
		}
	}
	return "", "", badRequest("tool_choice", `tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}`)
}

// withTools is a chat's messages as the model sees them with plan in force: the format's
// system message after the chat's own, assistant turns as the JSON the format makes them
// (their tool calls, or their text), and tool results as user messages that name their
// call. Without a plan, assistant tool calls and tool results still render that way.
func withTools(msgs []chatMessage, plan *toolPlan) ([]chatMessage, error) {
	names := map[string]string{} // call id → function name
	out := make([]chatMessage, 0, len(msgs)+1)
	system := plan != nil
	for i, m := range msgs {
		if system && m.Role != "system" && m.Role != "developer" {
			out = append(out, chatMessage{Role: "system", Content: textContent{Text: plan.prompt}})
			system = false
		}
		switch {
		case m.Role == "assistant" && len(m.ToolCalls) > 0:
			var calls []string
			for j, c := range m.ToolCalls {
				args := strings.TrimSpace(c.Function.Arguments)
				if args == "" {
					args = "{}"
				}
				if !json.Valid([]byte(args)) {
					return nil, badRequest(fmt.Sprintf("messages[%d].tool_calls[%d].function.arguments", i, j), "arguments are not JSON")
				}
				var b bytes.Buffer
				json.Compact(&b, []byte(args))
				name, _ := json.Marshal(c.Function.Name)
				calls = append(calls, fmt.Sprintf(`{"name":%s,"arguments":%s}`, name, b.String()))
				names[c.ID] = c.Function.Name
			}
			out = append(out, chatMessage{Role: "assistant", Content: textContent{Text: `{"tool_calls":[` + strings.Join(calls, ",") + `]}`}})
		case m.Role == "assistant" && plan != nil && plan.text:
			text, _ := json.Marshal(m.Content.Text)
			out = append(out, chatMessage{Role: "assistant", Content: textContent{Text: `{"content":` + string(text) + `}`}})
		case m.Role == "tool":
			if m.ToolCallID == "" {
				return nil, badRequest(fmt.Sprintf("messages[%d].tool_call_id", i), "a tool message needs tool_call_id")
			}
			name := names[m.ToolCallID]
			if name == "" {
				return nil, badRequest(fmt.Sprintf("messages[%d].tool_call_id", i), "no earlier assistant message made call %q", m.ToolCallID)
			}
			out = append(out, chatMessage{Role: "user", Content: textContent{Text: fmt.Sprintf("Result of %s (call %s): %s", name, m.ToolCallID, m.Content.Text)}})
		default:
			out = append(out, m)
		}
	}
	if system {
		out = append(out, chatMessage{Role: "system", Content: textContent{Text: plan.prompt}})
	}
	return out, nil
}

// toolAnswer is a tool-format answer read back: its calls (each with a fresh id and its
// arguments as a JSON string), or its text. ok is false when text is not the format (an
// answer cut by max_tokens): it is then returned as text.
func toolAnswer(text string) (calls []toolCall, content string, ok bool) {
	var a struct {
		ToolCalls []struct {
			Name      string          `json:"name"`
			Arguments json.RawMessage `json:"arguments"`
		} `json:"tool_calls"`
		Content *string `json:"content"`
	}
	if json.Unmarshal([]byte(text), &a) != nil {
		return nil, text, false
	}
	if a.Content != nil {
		return nil, *a.Content, true
	}
	for _, c := range a.ToolCalls {
		var tc toolCall
		tc.ID, tc.Type, tc.Function.Name = "call_"+randomID(), "function", c.Name
		var b bytes.Buffer
		json.Compact(&b, c.Arguments)
		tc.Function.Arguments = b.String()
		calls = append(calls, tc)
	}
	return calls, "", len(calls) > 0
}

package node

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/infernode/infernode/node/hop"
	"github.com/infernode/infernode/session/infer"
)

// This file is the OpenAI request schema as infernode accepts it. Decoding is strict: a
// field infernode does not know is refused, and a known field it does not implement is
// refused unless its value leaves the answer unchanged (logprobs: false, tools: [], ...).

// params are the fields chat and text completions share.
type params struct {
	Model               string         `json:"model"`
	MaxTokens           *int           `json:"max_tokens"`
	MaxCompletionTokens *int           `json:"max_completion_tokens"`
	Temperature         *float64       `json:"temperature"`
	TopP                *float64       `json:"top_p"`
	TopK                *int           `json:"top_k"`          // llama.cpp extension
	MinP                *float64       `json:"min_p"`          // llama.cpp extension
	RepeatPenalty       *float64       `json:"repeat_penalty"` // llama.cpp extension
	PresencePenalty     *float64       `json:"presence_penalty"`
	FrequencyPenalty    *float64       `json:"frequency_penalty"`
	Seed                *int64         `json:"seed"`
	Stop                stopList       `json:"stop"`
	N                   *int           `json:"n"`
	Stream              bool           `json:"stream"`
	StreamOptions       *streamOptions `json:"stream_options"`
	User                string         `json:"user"`
	SessionID           string         `json:"session_id"`     // infernode extension: the conversation key
	CacheSalt           string         `json:"cache_salt"`     // vLLM's: share cached prefixes only with requests of the same salt
	ResponseCache       bool           `json:"response_cache"` // infernode extension: a greedy answer may come from the owner's response cache (see node/answers)

	echo bool // a text completion's echo: logprobs score the prompt too, and max_tokens may be 0 (the prompt's score alone)

	// Accepted only with values that change nothing.
	Logprobs          logprobsParam   `json:"logprobs"`
	TopLogprobs       *int            `json:"top_logprobs"`
	LogitBias         map[string]any  `json:"logit_bias"`
	ResponseFormat    *responseFormat `json:"response_format"`
	Tools             []tool          `json:"tools"`
	ToolChoice        any             `json:"tool_choice"`
	ParallelToolCalls *bool           `json:"parallel_tool_calls"`
	Store             *bool           `json:"store"`
	Metadata          map[string]any  `json:"metadata"`
	ServiceTier       *string         `json:"service_tier"` // "flex": batch priority (see infer.Request.Batch)
}

type streamOptions struct {
	IncludeUsage bool `json:"include_usage"`
}

// chatRequest is POST /v1/chat/completions.
type chatRequest struct {
	Messages []chatMessage `json:"messages"`
	params
}

type chatMessage struct {
	Role       string      `json:"role"`
	Content    textContent `json:"content"`
	Name       string      `json:"name"`
	ToolCalls  []toolCall  `json:"tool_calls"`   // assistant
	ToolCallID string      `json:"tool_call_id"` // tool
}

// completionRequest is POST /v1/completions.
type completionRequest struct {
	Prompt promptList `json:"prompt"`
	Echo   *bool      `json:"echo"`
	Suffix *string    `json:"suffix"`
	BestOf *int       `json:"best_of"`
	params
}

// stopList is "stop": a string or a list of strings.
type stopList []string

func (s *stopList) UnmarshalJSON(b []byte) error {
	if bytes.Equal(b, []byte("null")) {
		*s = nil
		return nil
	}
	var one string
	if json.Unmarshal(b, &one) == nil {
		*s = stopList{one}
		return nil
	}
	var many []string
	if err := json.Unmarshal(b, &many); err != nil {
		return badRequest("stop", "stop must be a string or a list of strings")
	}
	*s = many
	return nil
}

// textContent is a message's content: a string, a list of text parts, or null.
type textContent struct {
	Text string
	Null bool
}

func (c *textContent) UnmarshalJSON(b []byte) error {
	if bytes.Equal(b, []byte("null")) {
		*c = textContent{Null: true}
		return nil
	}
	if json.Unmarshal(b, &c.Text) == nil {
		return nil
	}
	var parts []struct {
		Type string  `json:"type"`
		Text *string `json:"text"`
	}
	if err := json.Unmarshal(b, &parts); err != nil {
		return badRequest("messages", "message content must be a string or a list of text parts")
	}
	var sb strings.Builder
	for _, p := range parts {
		if p.Type != "text" || p.Text == nil {
			return badRequest("messages", "content part type %q is not supported: infernode serves text only", p.Type)
		}
		sb.WriteString(*p.Text)
	}
	c.Text = sb.String()
	return nil
}

// logprobsParam is "logprobs": true or false on chat, the number of most likely
// alternatives to list on completions (legacy; 0 lists only the chosen token's).
type logprobsParam struct {
	On  bool
	Top int
}

func (l *logprobsParam) UnmarshalJSON(b []byte) error {
	var on bool
	if json.Unmarshal(b, &on) == nil || bytes.Equal(b, []byte("null")) {
		*l = logprobsParam{On: on}
		return nil
	}
	var n int
	if err := json.Unmarshal(b, &n); err != nil || n < 0 {
		return badRequest("logprobs", "logprobs must be true, false or (on completions) a number of alternatives")
	}
	*l = logprobsParam{On: true, Top: n}
	return nil
}

// maxChoices bounds n: each choice is a generation of its own.
const maxChoices = 16

// maxPrompts bounds the prompts of one completions request (a harness's batch).
const maxPrompts = 256

// prompt is one of a completion's prompts: text, or the model's token ids.
type prompt struct {
	Text   string
	Tokens []int32
}

// promptList is a completion's prompt: a string, a list of token ids, or a list of
// either (a batch, answered in one choice each).
type promptList []prompt

func (p *promptList) UnmarshalJSON(b []byte) error {
	var one prompt
	if one.read(b) {
		*p = promptList{one}
		return nil
	}
	var many []json.RawMessage
	if json.Unmarshal(b, &many) != nil || len(many) == 0 {
		return badRequest("prompt", "prompt must be a string, a list of token ids, or a list of either")
	}
	if len(many) > maxPrompts {
		return badRequest("prompt", "at most %d prompts a request, got %d", maxPrompts, len(many))
	}
	out := make(promptList, len(many))
	for i, raw := range many {
		if !out[i].read(raw) {
			return badRequest("prompt", "prompt %d must be a string or a list of token ids", i)
		}
	}
	*p = out
	return nil
}

// read reads a string or a non-empty list of token ids.
func (p *prompt) read(b []byte) bool {
	if json.Unmarshal(b, &p.Text) == nil {
		return true
	}
	return json.Unmarshal(b, &p.Tokens) == nil && len(p.Tokens) > 0
}

// decodeJSON decodes a request body strictly into v and turns every decoding failure into
// a 400 that names the offending field.
func decodeJSON(body []byte, v any) error {
	if len(bytes.TrimSpace(body)) == 0 {
		return badRequest("", "request body is empty; send a JSON object")
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	err := dec.Decode(v)
	if err == nil {
		if _, extra := dec.Token(); extra != io.EOF {
			return badRequest("", "request body has data after the JSON object")
		}
		return nil
	}
	var ae *hop.Error
	var typeErr *json.UnmarshalTypeError
	var syntaxErr *json.SyntaxError
	switch {
	case errors.As(err, &ae):
		return ae
	case errors.As(err, &typeErr):
		field := strings.TrimPrefix(typeErr.Field, "params.") // the embedded struct's name
		if field == "" {
			return badRequest("", "request body must be a JSON object")
		}
		return badRequest(field, "field %q must be of type %s, not %s", field, typeErr.Type, typeErr.Value)
	case errors.As(err, &syntaxErr):
		return badRequest("", "malformed JSON at byte %d: %v", syntaxErr.Offset, syntaxErr)
	case errors.Is(err, io.ErrUnexpectedEOF):
		return badRequest("", "malformed JSON: body ends too early")
	case strings.HasPrefix(err.Error(), "json: unknown field "):
		field := strings.Trim(strings.TrimPrefix(err.Error(), "json: unknown field "), `"`)
		return unsupported(field)
	default:
		return badRequest("", "malformed JSON: %v", err)
	}
}

// sessionRequest checks the shared fields and builds the engine request (without prompt);
// Server.check applies the limits every request shares.
func (p *params) sessionRequest() (infer.Request, error) {
	req := infer.Request{Sampling: infer.DefaultSampling()}
	if err := p.refuseUnsupported(); err != nil {
		return req, err
	}
	if p.N != nil && (*p.N < 1 || *p.N > maxChoices) {
		return req, badRequest("n", "n must be in [1, %d], got %d", maxChoices, *p.N)
	}
	if p.N != nil && *p.N > 1 && p.Stream {
		return req, badRequest("n", "n > 1 is supported without stream only")
	}
	maxTokens, param := p.MaxTokens, "max_tokens"
	if p.MaxCompletionTokens != nil {
		maxTokens, param = p.MaxCompletionTokens, "max_completion_tokens"
	}
	if maxTokens != nil && *maxTokens == 0 && p.echo {
		req.PrefillOnly = true
	} else if maxTokens != nil {
		if *maxTokens < 1 {
			return req, badRequest(param, "%s must be at least 1, got %d", param, *maxTokens)
		}
		req.MaxTokens = *maxTokens
	}
	set := func(dst *float32, src *float64) {
		if src != nil {
			*dst = float32(*src)
		}
	}
	set(&req.Temperature, p.Temperature)
	set(&req.TopP, p.TopP)
	set(&req.MinP, p.MinP)
	set(&req.RepeatPenalty, p.RepeatPenalty)
	set(&req.PresencePenalty, p.PresencePenalty)
	set(&req.FrequencyPenalty, p.FrequencyPenalty)
	if p.TopK != nil {
		req.TopK = *p.TopK
	}
	if p.Seed != nil {
		req.Seed = *p.Seed
		if req.Seed < 0 {
			return req, badRequest("seed", "seed must not be negative, got %d", *p.Seed)
		}
	}
	req.Stop = p.Stop
	req.CacheAnswer = p.ResponseCache
	if p.ServiceTier != nil {
		switch *p.ServiceTier {
		case "flex":
			req.Batch = true
		case "auto", "default", "priority", "scale":
		default:
			return req, badRequest("service_tier", "service_tier must be auto, default, flex or priority, got %q", *p.ServiceTier)
		}
	}
	req.Logprobs, req.TopLogprobs = p.Logprobs.On, p.Logprobs.Top
	if p.echo {
		req.PromptLogprobs = req.Logprobs
		req.Logprobs = req.Logprobs && !req.PrefillOnly // no token is generated to score
	}
	if p.TopLogprobs != nil {
		req.TopLogprobs = *p.TopLogprobs
	}
	schema, err := p.ResponseFormat.schema()
	if err != nil {
		return req, err
	}
	req.Schema = schema
	return req, nil
}

func (p *params) refuseUnsupported() error {
	switch {
	case p.Logprobs.On && p.Stream:
		e := unsupported("logprobs")
		e.Message = "logprobs are supported without stream only"
		return e
	case len(p.LogitBias) > 0:
		return unsupported("logit_bias")
	}
	return nil
}

// chatMessages checks roles and content and returns the conversation for the template.
// maxMessages bounds a chat's messages: far more than a context holds, and every one is
// copied to C for the chat template.
const maxMessages = 10000

func chatMessages(msgs []chatMessage) ([]infer.Message, error) {
	if len(msgs) == 0 {
		return nil, badRequest("messages", "messages must not be empty")
	}
	if len(msgs) > maxMessages {
		return nil, badRequest("messages", "a chat may have at most %d messages, got %d", maxMessages, len(msgs))
	}
	out := make([]infer.Message, 0, len(msgs))
	for i, m := range msgs {
		role := m.Role
		switch role {
		case "system", "user", "assistant":
		case "developer":
			role = "system"
		case "":
			return nil, badRequest(fmt.Sprintf("messages[%d].role", i), "message %d has no role", i)
		default:
			return nil, badRequest(fmt.Sprintf("messages[%d].role", i),
				"role %q is not supported (use system, developer, user, assistant or tool)", m.Role)
		}
		if m.Content.Null && role != "assistant" {
			return nil, badRequest(fmt.Sprintf("messages[%d].content", i), "message %d (%s) has no content", i, role)
		}
		if strings.ContainsRune(m.Content.Text, 0) || strings.ContainsRune(m.Content.Text, '\uFDD0') {
			return nil, badRequest(fmt.Sprintf("messages[%d].content", i), "message %d contains a NUL byte or U+FDD0", i)
		}
		out = append(out, infer.Message{Role: role, Content: m.Content.Text})
	}
	return out, nil
}

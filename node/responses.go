package node

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/infernode/infernode/node/hop"
	"github.com/infernode/infernode/node/stored"
	"github.com/infernode/infernode/session/infer"
)

// The Responses API (POST /v1/responses, GET and DELETE /v1/responses/{id}) as a chat:
// input items become chat messages (function calls and their outputs as tool calls and
// tool messages), the answer becomes output items. A stored response keeps the
// conversation up to it, with its conversation on the conversation's owner and the
// owner's heirs (see node/stored); its id, and its items' ids, carry the conversation's
// key under a MAC (see ids.go), so any node routes a previous_response_id, an
// item_reference, a GET or a DELETE to the owner, where the next turn is warm.

// responsesRequest is POST /v1/responses. Fields the SDKs send that change nothing here
// are accepted and ignored; fields that would change the answer in ways infernode does
// not implement are refused when set (see refuse).
type responsesRequest struct {
	Model              string          `json:"model"`
	Input              json.RawMessage `json:"input"`
	Instructions       *string         `json:"instructions"`
	MaxOutputTokens    *int            `json:"max_output_tokens"`
	Temperature        *float64        `json:"temperature"`
	TopP               *float64        `json:"top_p"`
	Text               *responsesText  `json:"text"`
	Tools              []responsesTool `json:"tools"`
	ToolChoice         any             `json:"tool_choice"`
	ParallelToolCalls  *bool           `json:"parallel_tool_calls"`
	Store              *bool           `json:"store"`
	Stream             bool            `json:"stream"`
	PreviousResponseID string          `json:"previous_response_id"`
	PromptCacheKey     string          `json:"prompt_cache_key"` // names the conversation, as session_id does
	User               string          `json:"user"`
	Seed               *int64          `json:"seed"`           // infernode extension, as on chat
	ResponseCache      bool            `json:"response_cache"` // infernode extension, as on chat

	// Accepted and ignored: they do not change the answer.
	Metadata             map[string]any `json:"metadata"`
	Include              []string       `json:"include"`
	Truncation           *string        `json:"truncation"`
	SafetyIdentifier     *string        `json:"safety_identifier"`
	ServiceTier          *string        `json:"service_tier"` // "flex": batch priority
	PromptCacheRetention *string        `json:"prompt_cache_retention"`
	Reasoning            any            `json:"reasoning"`
	MaxToolCalls         *int           `json:"max_tool_calls"`
	StreamOptions        any            `json:"stream_options"`

	// Refused when set.
	TopLogprobs  *int `json:"top_logprobs"`
	Background   bool `json:"background"`
	Conversation any  `json:"conversation"`
	Prompt       any  `json:"prompt"`
}

type responsesText struct {
	Format *struct {
		Type        string          `json:"type"`
		Name        string          `json:"name"`
		Description string          `json:"description"`
		Schema      json.RawMessage `json:"schema"`
		Strict      *bool           `json:"strict"`
	} `json:"format"`
	Verbosity *string `json:"verbosity"` // ignored
}

// responsesTool is a function tool as the Responses API shapes it (flat, not nested
// under "function").
type responsesTool struct {
	Type        string          `json:"type"`
	Name        string          `json:"name"`
	Description string          `json:"description"`
	Parameters  json.RawMessage `json:"parameters"`
	Strict      *bool           `json:"strict"`
}

// refuse names the first field set that infernode does not implement.
func (r *responsesRequest) refuse() error {
	switch {
	case r.TopLogprobs != nil && *r.TopLogprobs > 0:
		return unsupported("top_logprobs")
	case r.Background:
		return badRequest("background", "background responses are not supported: use stream or wait for the answer")
	case r.Conversation != nil:
		return badRequest("conversation", "conversation objects are not supported: chain responses with previous_response_id")
	case r.Prompt != nil:
		return badRequest("prompt", "prompt templates are not supported: send input")
	}
	return nil
}

// turnItem is an item of a conversation as infernode keeps it: input items after
// resolving references, and output items.
type turnItem struct {
	ID        string `json:"id,omitempty"`
	Type      string `json:"type"` // message, function_call, function_call_output
	Role      string `json:"role,omitempty"`
	Text      string `json:"text,omitempty"` // a message's text, a call output's output
	CallID    string `json:"call_id,omitempty"`
	Name      string `json:"name,omitempty"`
	Arguments string `json:"arguments,omitempty"`
}

// inputItem is an input item as clients send it.
type inputItem struct {
	Type      string          `json:"type"`
	ID        string          `json:"id"`
	Role      string          `json:"role"`
	Content   json.RawMessage `json:"content"`
	CallID    string          `json:"call_id"`
	Name      string          `json:"name"`
	Arguments string          `json:"arguments"`
	Output    json.RawMessage `json:"output"`
}

// maxInputItems bounds a request's items, as maxMessages bounds a chat's.
const maxInputItems = maxMessages

// parseInput reads input: a string (one user message) or a list of items. References
// stay as items of type item_reference, resolved by the caller.
func parseInput(raw json.RawMessage) ([]turnItem, error) {
	var text string
	if len(raw) == 0 || bytes.Equal(raw, []byte("null")) {
		return nil, badRequest("input", "input is required: a string or a list of items")
	}
	if json.Unmarshal(raw, &text) == nil {
		return []turnItem{{Type: "message", Role: "user", Text: text}}, nil
	}
	var items []inputItem
	if err := json.Unmarshal(raw, &items); err != nil {
		return nil, badRequest("input", "input must be a string or a list of items")
	}
	if len(items) > maxInputItems {
		return nil, badRequest("input", "input may have at most %d items, got %d", maxInputItems, len(items))
	}
	out := make([]turnItem, 0, len(items))
	for i, it := range items {
		param := fmt.Sprintf("input[%d]", i)
		t := turnItem{Type: it.Type, ID: it.ID}
		switch it.Type {
		case "", "message":
			t.Type, t.Role = "message", it.Role
			switch it.Role {
			case "user", "system", "developer", "assistant":
			default:
				return nil, badRequest(param+".role", "message role must be user, system, developer or assistant, got %q", it.Role)
			}
			var err error
			if t.Text, err = itemText(it.Content, param+".content"); err != nil {
				return nil, err
			}
		case "function_call":
			if it.CallID == "" || it.Name == "" {
				return nil, badRequest(param, "a function_call item needs call_id and name")
			}
			t.CallID, t.Name, t.Arguments = it.CallID, it.Name, it.Arguments
		case "function_call_output":
			if it.CallID == "" {
				return nil, badRequest(param+".call_id", "a function_call_output item needs call_id")
			}
			var err error
			if t.Text, err = itemText(it.Output, param+".output"); err != nil {
				return nil, err
			}
			t.CallID = it.CallID
		case "item_reference":
			if it.ID == "" {
				return nil, badRequest(param+".id", "an item_reference needs id")
			}
		case "reasoning":
			continue // none is made here; another model's reasoning does not change this one's answer
		default:
			return nil, badRequest(param+".type", "input item type %q is not supported (message, function_call, function_call_output, item_reference)", it.Type)
		}
		out = append(out, t)
	}
	return out, nil
}

// itemText is a message's content or a call's output: a string, or text parts.
func itemText(raw json.RawMessage, param string) (string, error) {
	var text string
	if json.Unmarshal(raw, &text) == nil {
		return text, nil
	}
	var parts []struct {
		Type string  `json:"type"`
		Text *string `json:"text"`
	}
	if err := json.Unmarshal(raw, &parts); err != nil {
		return "", badRequest(param, "content must be a string or a list of text parts")
	}
	var sb strings.Builder
	for _, p := range parts {
		switch {
		case p.Text == nil:
			return "", badRequest(param, "content part type %q is not supported: infernode serves text only", p.Type)
		case p.Type == "input_text", p.Type == "output_text", p.Type == "text", p.Type == "refusal":
			sb.WriteString(*p.Text)
		default:
			return "", badRequest(param, "content part type %q is not supported: infernode serves text only", p.Type)
		}
	}
	return sb.String(), nil
}

// chatOf is a conversation's items as chat messages: consecutive function calls become
// one assistant message's tool calls, their outputs tool messages.
func chatOf(items []turnItem) []chatMessage {
	var out []chatMessage
	for _, it := range items {
		switch it.Type {
		case "message":
			out = append(out, chatMessage{Role: it.Role, Content: textContent{Text: it.Text}})
		case "function_call":
			var tc toolCall
			tc.ID, tc.Type, tc.Function.Name, tc.Function.Arguments = it.CallID, "function", it.Name, it.Arguments
			if n := len(out); n > 0 && out[n-1].Role == "assistant" && len(out[n-1].ToolCalls) > 0 {
				out[n-1].ToolCalls = append(out[n-1].ToolCalls, tc)
				continue
			}
			out = append(out, chatMessage{Role: "assistant", Content: textContent{Null: true}, ToolCalls: []toolCall{tc}})
		case "function_call_output":
			out = append(out, chatMessage{Role: "tool", ToolCallID: it.CallID, Content: textContent{Text: it.Text}})
		}
	}
	return out
}

// storedBody is a stored record's body: the response as GET returns it, and the
// conversation up to and including its output.
type storedBody struct {
	Response json.RawMessage `json:"response"`
	History  []turnItem      `json:"history"`
}

// responseTurn is what a Responses API request adds to its completion.
type responseTurn struct {
	req       *responsesRequest
	principal string
	history   []turnItem // the conversation before this turn's input, and its input
	inputs    int        // of which the last inputs are this turn's
	store     bool
	created   time.Time
	obj       responseObject // as created: status and output follow
	message   string         // the id of the answer's message item
	seq       int            // the next event's sequence_number
}

// handleResponses serves POST /v1/responses.
func (s *Server) handleResponses(ctx *fasthttp.RequestCtx) {
	c, err := s.parseResponses(ctx)
	if err != nil {
		writeError(ctx, err)
		return
	}
	if s.admit(ctx, c) {
		s.generate(ctx, c, s.submitFor(c))
	}
}

func (s *Server) parseResponses(ctx *fasthttp.RequestCtx) (*completion, error) {
	if ct := ctx.Request.Header.ContentType(); !jsonContentType(ct) {
		return nil, errContentType
	}
	var r responsesRequest
	if err := decodeJSON(ctx.PostBody(), &r); err != nil {
		return nil, err
	}
	if err := r.refuse(); err != nil {
		return nil, err
	}
	t, _ := s.client(ctx)
	turn := &responseTurn{req: &r, principal: t.principal(s.cfg.APIKey, r.User), store: r.Store == nil || *r.Store, created: time.Now()}
	input, err := parseInput(r.Input)
	if err != nil {
		return nil, err
	}
	// The conversation: the previous response's, or the one the input's references name.
	key := ""
	if r.PreviousResponseID != "" {
		k, rec, err := s.fetchStored(ctx, r.PreviousResponseID, "resp", turn.principal)
		if err != nil {
			return nil, previousNotFound(r.PreviousResponseID, err)
		}
		var body storedBody
		if err := json.Unmarshal(rec.Body, &body); err != nil {
			return nil, err
		}
		key, turn.history = k, body.History
	}
	known := map[string]turnItem{} // the items of the records fetched so far: one fetch serves many references
	for i, it := range input {
		if it.Type != "item_reference" {
			continue
		}
		item, ok := known[it.ID]
		if !ok {
			k, history, err := s.resolveItem(ctx, it.ID, turn.principal)
			if err != nil {
				return nil, &hop.Error{Status: fasthttp.StatusNotFound, Type: "invalid_request_error", Param: fmt.Sprintf("input[%d].id", i),
					Code: "item_not_found", Message: fmt.Sprintf("item %q not found: %v", it.ID, err)}
			}
			key = cmp.Or(key, k)
			for _, h := range history {
				known[h.ID] = h
			}
			item = known[it.ID]
		}
		input[i] = item
	}
	turn.inputs = len(input)
	turn.history = append(turn.history, input...)
	if size := historyBytes(turn.history); turn.store && size > maxHistoryBytes {
		return nil, badRequest("input", "the conversation has %d bytes of text, more than the %d a stored response keeps: send store: false", size, maxHistoryBytes)
	}

	msgs := chatOf(turn.history)
	if r.Instructions != nil && *r.Instructions != "" {
		msgs = append([]chatMessage{{Role: "system", Content: textContent{Text: *r.Instructions}}}, msgs...)
	}
	if len(msgs) == 0 {
		return nil, badRequest("input", "input has no message")
	}
	chat := chatRequest{Messages: msgs, params: params{Model: r.Model, MaxTokens: r.MaxOutputTokens, Temperature: r.Temperature,
		TopP: r.TopP, Seed: r.Seed, Stream: r.Stream, User: r.User, SessionID: r.PromptCacheKey, ServiceTier: r.ServiceTier, ResponseCache: r.ResponseCache,
		ToolChoice: r.ToolChoice, ParallelToolCalls: r.ParallelToolCalls}}
	if r.MaxOutputTokens != nil {
		chat.MaxTokens = nil
		chat.MaxCompletionTokens = r.MaxOutputTokens // named max_output_tokens in errors
	}
	for i, tl := range r.Tools {
		if tl.Type != "function" {
			return nil, badRequest(fmt.Sprintf("tools[%d].type", i), "tool type %q is not supported: infernode calls functions only", tl.Type)
		}
		var ct tool
		ct.Type, ct.Function.Name, ct.Function.Description, ct.Function.Parameters, ct.Function.Strict = "function", tl.Name, tl.Description, tl.Parameters, tl.Strict
		chat.Tools = append(chat.Tools, ct)
	}
	if m, ok := r.ToolChoice.(map[string]any); ok && m["type"] == "function" && m["function"] == nil {
		chat.ToolChoice = map[string]any{"type": "function", "function": map[string]any{"name": m["name"]}} // the Responses API's flat form
	}
	if f := r.Text; f != nil && f.Format != nil {
		rf := &responseFormat{Type: f.Format.Type}
		if f.Format.Type == "json_schema" {
			rf.JSONSchema = &struct {
				Name        string          `json:"name"`
				Description string          `json:"description"`
				Schema      json.RawMessage `json:"schema"`
				Strict      *bool           `json:"strict"`
			}{f.Format.Name, f.Format.Description, f.Format.Schema, f.Format.Strict}
		}
		chat.ResponseFormat = rf
	}
	c := &completion{chat: true, endpoint: "/v1/responses", start: turn.created, resp: turn}
	if _, err := s.chatCompletion(ctx, c, &chat); err != nil {
		var e *hop.Error
		if errors.As(err, &e) {
			if p, ok := e.Param.(string); ok {
				e.Param = responsesParam(p)
			}
		}
		return nil, err
	}
	if key != "" {
		c.req.SessionID = key
		c.req.FollowUp = true
	}
	c.id = s.ids.mint("resp", c.req.SessionID)
	turn.message = s.ids.mint("msg", c.req.SessionID)
	for i := len(turn.history) - turn.inputs; i < len(turn.history); i++ {
		if it := &turn.history[i]; it.ID == "" {
			it.ID = s.ids.mint(map[string]string{"message": "msg", "function_call": "fc", "function_call_output": "fco"}[it.Type], c.req.SessionID)
		}
	}
	turn.obj = turn.object(c)
	return c, nil
}

func historyBytes(items []turnItem) int {
	n := 0
	for _, it := range items {
		n += len(it.Text) + len(it.Arguments) + len(it.Name) + len(it.CallID) + len(it.ID)
	}
	return n
}

// responsesParam names a chat field as the Responses API does.
func responsesParam(p string) string {
	switch {
	case p == "max_completion_tokens":
		return "max_output_tokens"
	case p == "response_format":
		return "text.format"
	case strings.HasPrefix(p, "messages"):
		return "input"
	}
	return p
}

func previousNotFound(id string, err error) *hop.Error {
	return &hop.Error{Status: fasthttp.StatusNotFound, Type: "invalid_request_error", Param: "previous_response_id",
		Code: "previous_response_not_found", Message: fmt.Sprintf("previous response %q not found: %v", id, err)}
}

// fetchStored finds a stored record by its id or an item's (of kind prefix), among the
// nodes that keep its conversation, and returns the conversation's key with it.
func (s *Server) fetchStored(ctx *fasthttp.RequestCtx, id, prefix, principal string) (string, stored.Record, error) {
	kind, key, ok := s.ids.read(id, principal)
	if !ok || (prefix != "" && kind != prefix) {
		return "", stored.Record{}, errors.New("not an id this cluster issued to this API key")
	}
	rctx, cancel := context.WithTimeout(s.base, 10*time.Second)
	defer cancel()
	rec, err := s.cluster.Stored().Get(rctx, key, id)
	if err != nil {
		return "", stored.Record{}, err
	}
	return key, rec, nil
}

// resolveItem finds the item an item_reference names: its conversation's key and the
// stored conversation that holds it.
func (s *Server) resolveItem(ctx *fasthttp.RequestCtx, id, principal string) (string, []turnItem, error) {
	key, rec, err := s.fetchStored(ctx, id, "", principal)
	if err != nil {
		return "", nil, err
	}
	var body storedBody
	if err := json.Unmarshal(rec.Body, &body); err != nil {
		return "", nil, err
	}
	if !slices.ContainsFunc(body.History, func(it turnItem) bool { return it.ID == id }) {
		return "", nil, stored.ErrNotFound
	}
	return key, body.History, nil
}

// handleResponse serves GET and DELETE /v1/responses/{id}.
func (s *Server) handleResponse(ctx *fasthttp.RequestCtx, id string) {
	t, _ := s.client(ctx)
	principal := t.principal(s.cfg.APIKey, string(ctx.QueryArgs().Peek("user")))
	notFound := &hop.Error{Status: fasthttp.StatusNotFound, Type: "invalid_request_error", Param: "response_id", Code: "not_found",
		Message: fmt.Sprintf("response %q not found", id)}
	kind, key, ok := s.ids.read(id, principal)
	if !ok || kind != "resp" {
		writeError(ctx, notFound)
		return
	}
	rctx, cancel := context.WithTimeout(s.base, 10*time.Second)
	defer cancel()
	if string(ctx.Method()) == fasthttp.MethodDelete {
		found, err := s.cluster.Stored().Delete(rctx, key, id)
		switch {
		case err != nil:
			writeError(ctx, &hop.Error{Status: fasthttp.StatusServiceUnavailable, Type: "server_error", Code: "unavailable", RetryAfter: 1,
				Message: fmt.Sprintf("response %q may not be deleted everywhere it is kept: %v", id, err)})
		case !found:
			writeError(ctx, notFound)
		default:
			writeJSON(ctx, fasthttp.StatusOK, map[string]any{"id": id, "object": "response", "deleted": true})
		}
		return
	}
	rec, err := s.cluster.Stored().Get(rctx, key, id)
	if err != nil {
		writeError(ctx, notFound)
		return
	}
	var body storedBody
	if err := json.Unmarshal(rec.Body, &body); err != nil || rec.ID != id {
		writeError(ctx, notFound)
		return
	}
	ctx.SetStatusCode(fasthttp.StatusOK)
	ctx.SetContentType("application/json")
	ctx.SetBody(body.Response)
}

// The response object, its items and usage, as OpenAI shapes them.

type responseObject struct {
	ID                 string          `json:"id"`
	Object             string          `json:"object"`
	CreatedAt          int64           `json:"created_at"`
	CompletedAt        *int64          `json:"completed_at"`
	Status             string          `json:"status"`
	IncompleteDetails  *incomplete     `json:"incomplete_details"`
	Model              string          `json:"model"`
	PreviousResponseID *string         `json:"previous_response_id"`
	Instructions       *string         `json:"instructions"`
	Output             []outputItem    `json:"output"`
	Error              *responseError  `json:"error"`
	Tools              []responsesTool `json:"tools"`
	ToolChoice         any             `json:"tool_choice"`
	Truncation         string          `json:"truncation"`
	ParallelToolCalls  bool            `json:"parallel_tool_calls"`
	Text               map[string]any  `json:"text"`
	TopP               float32         `json:"top_p"`
	PresencePenalty    float32         `json:"presence_penalty"`
	FrequencyPenalty   float32         `json:"frequency_penalty"`
	TopLogprobs        int             `json:"top_logprobs"`
	Temperature        float32         `json:"temperature"`
	Reasoning          map[string]any  `json:"reasoning"`
	Usage              *responsesUsage `json:"usage"`
	MaxOutputTokens    *int            `json:"max_output_tokens"`
	MaxToolCalls       *int            `json:"max_tool_calls"`
	Store              bool            `json:"store"`
	Background         bool            `json:"background"`
	ServiceTier        string          `json:"service_tier"`
	Metadata           map[string]any  `json:"metadata"`
	SafetyIdentifier   *string         `json:"safety_identifier"`
	PromptCacheKey     *string         `json:"prompt_cache_key"`
	User               *string         `json:"user,omitempty"`
}

type incomplete struct {
	Reason string `json:"reason"`
}

type responseError struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

type responsesUsage struct {
	InputTokens         int            `json:"input_tokens"`
	InputTokensDetails  map[string]int `json:"input_tokens_details"`
	OutputTokens        int            `json:"output_tokens"`
	OutputTokensDetails map[string]int `json:"output_tokens_details"`
	TotalTokens         int            `json:"total_tokens"`
	ResponseCached      bool           `json:"response_cached,omitempty"` // infernode extension, as on chat
}

// outputItem is a message or a function call of a response's output.
type outputItem struct {
	Type      string        `json:"type"`
	ID        string        `json:"id"`
	Status    string        `json:"status"`
	Role      string        `json:"role,omitempty"`
	Content   *[]outputPart `json:"content,omitempty"` // a message's, even when empty
	CallID    string        `json:"call_id,omitempty"`
	Name      string        `json:"name,omitempty"`
	Arguments *string       `json:"arguments,omitempty"`
}

type outputPart struct {
	Type        string `json:"type"`
	Text        string `json:"text"`
	Annotations []any  `json:"annotations"`
	Logprobs    []any  `json:"logprobs"`
}

// maxHistoryBytes bounds the text of a stored conversation, so that its record (with the
// answer and the response) stays within stored.MaxRecordBytes.
const maxHistoryBytes = stored.MaxRecordBytes / 2

// object is the response as created: in progress, without output.
func (t *responseTurn) object(c *completion) responseObject {
	r := t.req
	o := responseObject{ID: c.id, Object: "response", CreatedAt: t.created.Unix(), Status: "in_progress", Model: c.model,
		Instructions: r.Instructions, Output: []outputItem{}, Tools: r.Tools, ToolChoice: r.ToolChoice, Truncation: "disabled",
		ParallelToolCalls: r.ParallelToolCalls == nil || *r.ParallelToolCalls, TopP: c.req.TopP, Temperature: c.req.Temperature,
		Reasoning: map[string]any{"effort": nil, "summary": nil}, MaxOutputTokens: r.MaxOutputTokens, MaxToolCalls: r.MaxToolCalls,
		Store: t.store, ServiceTier: map[bool]string{true: "flex", false: "default"}[c.req.Batch], Metadata: r.Metadata, SafetyIdentifier: r.SafetyIdentifier,
		PresencePenalty: c.req.PresencePenalty, FrequencyPenalty: c.req.FrequencyPenalty}
	if o.Tools == nil {
		o.Tools = []responsesTool{}
	}
	if o.ToolChoice == nil {
		o.ToolChoice = "auto"
	}
	if o.Metadata == nil {
		o.Metadata = map[string]any{}
	}
	if r.PreviousResponseID != "" {
		o.PreviousResponseID = &r.PreviousResponseID
	}
	if r.PromptCacheKey != "" {
		o.PromptCacheKey = &r.PromptCacheKey
	}
	if r.User != "" {
		o.User = &r.User
	}
	format := map[string]any{"type": "text"}
	if f := r.Text; f != nil && f.Format != nil && f.Format.Type != "" {
		format = map[string]any{"type": f.Format.Type}
		if f.Format.Type == "json_schema" {
			format["name"], format["schema"], format["strict"] = f.Format.Name, f.Format.Schema, f.Format.Strict == nil || *f.Format.Strict
			if f.Format.Description != "" {
				format["description"] = f.Format.Description
			}
		}
	}
	o.Text = map[string]any{"format": format, "verbosity": "medium"}
	return o
}

// outputOf is the answer's output items: its function calls, or its message (msgID).
func (s *Server) outputOf(c *completion, text, msgID string) []outputItem {
	if c.tools != nil {
		calls, content, ok := toolAnswer(text)
		if ok && calls != nil {
			out := make([]outputItem, 0, len(calls))
			for _, tc := range calls {
				args := tc.Function.Arguments
				out = append(out, outputItem{Type: "function_call", ID: s.ids.mint("fc", c.req.SessionID), Status: "completed",
					CallID: tc.ID, Name: tc.Function.Name, Arguments: &args})
			}
			return out
		}
		text = content
	}
	parts := []outputPart{{Type: "output_text", Text: text, Annotations: []any{}, Logprobs: []any{}}}
	return []outputItem{{Type: "message", ID: msgID, Status: "completed", Role: "assistant", Content: &parts}}
}

// finishResponse completes c's response from its answer and stores it (when asked to):
// on the node that served the turn, and that node's heirs.
func (s *Server) finishResponse(c *completion, st infer.Stream, text string, res infer.Result) (responseObject, error) {
	t := c.resp
	o := t.obj
	o.Output = s.outputOf(c, text, t.message)
	o.Status = "completed"
	if res.FinishReason == "length" {
		o.Status, o.IncompleteDetails = "incomplete", &incomplete{Reason: "max_output_tokens"}
		for i := range o.Output {
			o.Output[i].Status = "incomplete"
		}
	}
	done := time.Now().Unix()
	o.CompletedAt = &done
	o.Usage = &responsesUsage{InputTokens: res.PromptTokens, InputTokensDetails: map[string]int{"cached_tokens": res.CachedTokens},
		OutputTokens: res.CompletionTokens, OutputTokensDetails: map[string]int{"reasoning_tokens": 0},
		TotalTokens: res.PromptTokens + res.CompletionTokens, ResponseCached: res.FromCache}
	if !t.store {
		return o, nil
	}
	history := slices.Clone(t.history)
	for _, it := range o.Output {
		ti := turnItem{ID: it.ID, Type: it.Type, CallID: it.CallID, Name: it.Name}
		if it.Type == "message" {
			ti.Role, ti.Text = "assistant", (*it.Content)[0].Text
		} else {
			ti.Arguments = *it.Arguments
		}
		history = append(history, ti)
	}
	resp, err := json.Marshal(o)
	if err != nil {
		return o, err
	}
	body, err := json.Marshal(storedBody{Response: resp, History: history})
	if err != nil {
		return o, err
	}
	rec := stored.Record{ID: o.ID, Expires: s.cluster.Stored().Expiry(), Body: body}
	for _, it := range history {
		if it.ID != "" {
			rec.Items = append(rec.Items, it.ID)
		}
	}
	node, _, _ := s.cluster.Route(st)
	ctx, cancel := context.WithTimeout(s.base, 10*time.Second)
	defer cancel()
	if err := s.cluster.Stored().Put(ctx, c.req.SessionID, rec, node); err != nil {
		return o, fmt.Errorf("store response %s: %w", o.ID, err)
	}
	return o, nil
}

// event writes one Responses API event, numbered.
func (t *responseTurn) event(sse *sseWriter, typ string, fields map[string]any) error {
	fields["type"], fields["sequence_number"] = typ, t.seq
	t.seq++
	b, err := json.Marshal(fields)
	if err != nil {
		return err
	}
	return sse.named(typ, b)
}

// streamResponse writes a Responses API answer as its events: the response created and
// in progress, the message's text as it comes (or, with tools, the answer's items once it
// is whole, as calls' arguments in pieces), then the response completed, incomplete, or
// failed.
func (s *Server) streamResponse(sse *sseWriter, st infer.Stream, c *completion, first string, firstErr error, ended func()) error {
	t := c.resp
	for _, typ := range []string{"response.created", "response.in_progress"} {
		if err := t.event(sse, typ, map[string]any{"response": t.obj}); err != nil {
			return err
		}
	}
	msgID := t.message
	open := func(idx int, id string) error {
		item := outputItem{Type: "message", ID: id, Status: "in_progress", Role: "assistant", Content: &[]outputPart{}}
		if err := t.event(sse, "response.output_item.added", map[string]any{"output_index": idx, "item": item}); err != nil {
			return err
		}
		return t.event(sse, "response.content_part.added", map[string]any{"item_id": id, "output_index": idx, "content_index": 0,
			"part": outputPart{Type: "output_text", Annotations: []any{}, Logprobs: []any{}}})
	}
	delta := func(idx int, id, piece string) error {
		return t.event(sse, "response.output_text.delta", map[string]any{"item_id": id, "output_index": idx, "content_index": 0,
			"delta": piece, "logprobs": []any{}})
	}
	if c.tools == nil {
		if err := open(0, msgID); err != nil {
			return err
		}
	}
	var text strings.Builder
	if err := s.relay(sse, st, first, firstErr, func(piece string) error {
		text.WriteString(piece)
		if c.tools != nil {
			return nil // the answer's items go once it is whole
		}
		return delta(0, msgID, piece)
	}); err != nil {
		return err
	}
	res := st.Result()
	fail := func(code, message string) error {
		o := t.obj
		o.Status, o.Error = "failed", &responseError{Code: code, Message: message}
		return t.event(sse, "response.failed", map[string]any{"response": o})
	}
	if res.Err != nil {
		e := toAPIError(res.Err)
		s.log.Warn("stream failed", "id", c.id, "err", res.Err)
		code, _ := e.Code.(string)
		return fail(cmp.Or(code, "server_error"), e.Message)
	}
	ended()
	_, hops, _ := s.cluster.Route(st)
	if err := sse.comment("infernode-hops " + fmt.Sprint(hops)); err != nil {
		return err
	}
	o, err := s.finishResponse(c, st, text.String(), res)
	if err != nil {
		s.log.Warn("response not stored", "id", c.id, "err", err)
		return fail("server_error", err.Error())
	}
	for i, item := range o.Output {
		switch {
		case item.Type == "function_call":
			added := item
			added.Status, added.Arguments = "in_progress", new(string)
			if err := t.event(sse, "response.output_item.added", map[string]any{"output_index": i, "item": added}); err != nil {
				return err
			}
			const piece = 16 // bytes of arguments a delta
			for args := *item.Arguments; len(args) > 0; {
				n := min(piece, len(args))
				if err := t.event(sse, "response.function_call_arguments.delta", map[string]any{"item_id": item.ID, "output_index": i,
					"delta": args[:n]}); err != nil {
					return err
				}
				args = args[n:]
			}
			if err := t.event(sse, "response.function_call_arguments.done", map[string]any{"item_id": item.ID, "output_index": i,
				"name": item.Name, "arguments": *item.Arguments}); err != nil {
				return err
			}
		case c.tools != nil: // a text answer of the tools' format, whole
			if err := open(i, item.ID); err != nil {
				return err
			}
			if err := delta(i, item.ID, (*item.Content)[0].Text); err != nil {
				return err
			}
			fallthrough
		default:
			part := (*item.Content)[0]
			if err := t.event(sse, "response.output_text.done", map[string]any{"item_id": item.ID, "output_index": i, "content_index": 0,
				"text": part.Text, "logprobs": []any{}}); err != nil {
				return err
			}
			if err := t.event(sse, "response.content_part.done", map[string]any{"item_id": item.ID, "output_index": i, "content_index": 0,
				"part": part}); err != nil {
				return err
			}
		}
		if err := t.event(sse, "response.output_item.done", map[string]any{"output_index": i, "item": item}); err != nil {
			return err
		}
	}
	end := "response.completed"
	if o.Status == "incomplete" {
		end = "response.incomplete"
	}
	return t.event(sse, end, map[string]any{"response": o})
}

package node

import (
	"slices"

	"github.com/infernode/infernode/session/infer"
)

// OpenAI response objects. Field order and names follow OpenAI's API reference.

type usage struct {
	PromptTokens        int           `json:"prompt_tokens"`
	CompletionTokens    int           `json:"completion_tokens"`
	TotalTokens         int           `json:"total_tokens"`
	PromptTokensDetails promptDetails `json:"prompt_tokens_details"`
	// ResponseCached: the whole answer came from the response cache (an infernode
	// extension; see node/answers).
	ResponseCached bool `json:"response_cached,omitempty"`
}

type promptDetails struct {
	CachedTokens int `json:"cached_tokens"`
}

func usageOf(r infer.Result) usage {
	return usage{PromptTokens: r.PromptTokens, CompletionTokens: r.CompletionTokens,
		TotalTokens: r.PromptTokens + r.CompletionTokens, PromptTokensDetails: promptDetails{r.CachedTokens}, ResponseCached: r.FromCache}
}

type message struct {
	Role      string     `json:"role"`
	Content   *string    `json:"content"` // null when the message calls tools
	ToolCalls []toolCall `json:"tool_calls,omitempty"`
}

type delta struct {
	Role      string     `json:"role,omitempty"`
	Content   *string    `json:"content,omitempty"`
	ToolCalls []toolCall `json:"tool_calls,omitempty"`
}

type choice struct {
	Index        int      `json:"index"`
	Message      *message `json:"message,omitempty"` // chat
	Delta        *delta   `json:"delta,omitempty"`   // chat stream
	Text         *string  `json:"text,omitempty"`    // text completion
	Logprobs     any      `json:"logprobs"`
	FinishReason *string  `json:"finish_reason"`
}

type completionObject struct {
	ID      string   `json:"id"`
	Object  string   `json:"object"`
	Created int64    `json:"created"`
	Model   string   `json:"model"`
	Choices []choice `json:"choices"`
	Usage   *usage   `json:"usage,omitempty"`
}

func (c *completion) object(kind string) completionObject {
	return completionObject{ID: c.id, Object: kind, Created: c.start.Unix(), Model: c.model, Choices: []choice{}}
}

// response is the non-streaming answer; a text completion's begins with echoed (its
// prompt, when it asked for an echo).
func (c *completion) response(text, echoed string, res infer.Result) completionObject {
	finish := res.FinishReason
	ch := choice{FinishReason: &finish}
	kind := "text_completion"
	if c.chat {
		kind, ch.Message = "chat.completion", &message{Role: "assistant", Content: &text}
		if c.tools != nil {
			if calls, content, ok := toolAnswer(text); ok && calls != nil {
				ch.Message.Content, ch.Message.ToolCalls = nil, calls
				if finish == "stop" {
					finish = "tool_calls"
				}
			} else {
				ch.Message.Content = &content
			}
		}
		if c.req.Logprobs {
			ch.Logprobs = chatLogprobs(res.Logprobs)
		}
	} else {
		whole := echoed + text
		ch.Text = &whole
		if c.req.Logprobs || c.req.PromptLogprobs {
			var lps []infer.TokenLogprob
			if c.echo {
				lps = res.PromptLogprobs
			}
			ch.Logprobs = textLogprobs(append(slices.Clip(lps), res.Logprobs...), len(lps) > 0)
		}
	}
	o := c.object(kind)
	o.Choices = []choice{ch}
	u := usageOf(res)
	o.Usage = &u
	return o
}

// completionLogprobs are a text completion's logprobs in OpenAI's legacy shape, a list
// per token: its text, its log probability (null for a prompt's first token, which
// nothing precedes), the most likely alternatives, and its offset in the choice's text.
type completionLogprobs struct {
	Tokens        []string             `json:"tokens"`
	TokenLogprobs []*float32           `json:"token_logprobs"`
	TopLogprobs   []map[string]float32 `json:"top_logprobs"`
	TextOffset    []int                `json:"text_offset"`
}

// textLogprobs shapes lps so; prompted says the first is a prompt's first token.
func textLogprobs(lps []infer.TokenLogprob, prompted bool) completionLogprobs {
	out := completionLogprobs{Tokens: []string{}, TokenLogprobs: []*float32{}, TopLogprobs: []map[string]float32{}, TextOffset: []int{}}
	offset := 0
	for i, lp := range lps {
		out.Tokens = append(out.Tokens, lp.Token)
		out.TextOffset = append(out.TextOffset, offset)
		offset += len(lp.Token)
		if i == 0 && prompted {
			out.TokenLogprobs, out.TopLogprobs = append(out.TokenLogprobs, nil), append(out.TopLogprobs, nil)
			continue
		}
		v := lp.Logprob
		top := map[string]float32{}
		for _, t := range lp.Top {
			top[t.Token] = t.Logprob
		}
		out.TokenLogprobs, out.TopLogprobs = append(out.TokenLogprobs, &v), append(out.TopLogprobs, top)
	}
	return out
}

// chunk is one streamed piece: the assistant role announcement (chat), text, or the
// final chunk carrying finish.
func (c *completion) chunk(text string, role bool, finish *string) completionObject {
	ch := choice{FinishReason: finish}
	kind := "text_completion"
	if c.chat {
		kind, ch.Delta = "chat.completion.chunk", &delta{}
		if text != "" || finish == nil {
			ch.Delta.Content = &text
		}
		if role {
			ch.Delta.Role = "assistant"
		}
	} else {
		ch.Text = &text
	}
	o := c.object(kind)
	o.Choices = []choice{ch}
	return o
}

// toolChunks are a tools-format answer's chunks in OpenAI's shape, sent once it is whole:
// for each call, one delta with its index, id, type and name, then its arguments in
// pieces; or its text as one content delta. A call makes finish "tool_calls".
func (c *completion) toolChunks(text string, finish *string) []completionObject {
	calls, content, ok := toolAnswer(text)
	if !ok || calls == nil {
		return []completionObject{c.chunk(content, false, nil)}
	}
	if *finish == "stop" {
		*finish = "tool_calls"
	}
	const piece = 16 // bytes of arguments a delta
	var out []completionObject
	for i, call := range calls {
		add := func(tc toolCall) {
			idx := i
			tc.Index = &idx
			o := c.object("chat.completion.chunk")
			o.Choices = []choice{{Delta: &delta{ToolCalls: []toolCall{tc}}}}
			out = append(out, o)
		}
		head := call
		head.Function.Arguments = ""
		add(head)
		args := call.Function.Arguments
		for len(args) > 0 {
			n := min(piece, len(args))
			var tc toolCall
			tc.Function.Arguments = args[:n]
			add(tc)
			args = args[n:]
		}
	}
	return out
}

// usageChunk is the extra last chunk stream_options.include_usage asks for.
func (c *completion) usageChunk(res infer.Result) completionObject {
	kind := "text_completion"
	if c.chat {
		kind = "chat.completion.chunk"
	}
	o := c.object(kind)
	u := usageOf(res)
	o.Usage = &u
	return o
}

// logprobContent is one token in a chat answer's logprobs, as OpenAI shapes it.
type logprobContent struct {
	Token       string           `json:"token"`
	Logprob     float32          `json:"logprob"`
	Bytes       []int            `json:"bytes"`
	TopLogprobs []logprobContent `json:"top_logprobs,omitempty"`
}

func chatLogprobs(lps []infer.TokenLogprob) map[string]any {
	bytesOf := func(s string) []int {
		out := make([]int, len(s))
		for i := range len(s) {
			out[i] = int(s[i])
		}
		return out
	}
	content := make([]logprobContent, 0, len(lps))
	for _, lp := range lps {
		c := logprobContent{Token: lp.Token, Logprob: lp.Logprob, Bytes: bytesOf(lp.Token), TopLogprobs: []logprobContent{}}
		for _, t := range lp.Top {
			c.TopLogprobs = append(c.TopLogprobs, logprobContent{Token: t.Token, Logprob: t.Logprob, Bytes: bytesOf(t.Token)})
		}
		content = append(content, c)
	}
	return map[string]any{"content": content}
}

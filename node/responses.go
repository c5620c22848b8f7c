package node

import "github.com/infernode/infernode/session/infer"

// OpenAI response objects. Field order and names follow OpenAI's API reference.

type usage struct {
	PromptTokens        int           `json:"prompt_tokens"`
	CompletionTokens    int           `json:"completion_tokens"`
	TotalTokens         int           `json:"total_tokens"`
	PromptTokensDetails promptDetails `json:"prompt_tokens_details"`
}

type promptDetails struct {
	CachedTokens int `json:"cached_tokens"`
}

func usageOf(r infer.Result) usage {
	return usage{PromptTokens: r.PromptTokens, CompletionTokens: r.CompletionTokens,
		TotalTokens: r.PromptTokens + r.CompletionTokens, PromptTokensDetails: promptDetails{r.CachedTokens}}
}

type message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

type delta struct {
	Role    string `json:"role,omitempty"`
	Content string `json:"content"`
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

// response is the non-streaming answer.
func (c *completion) response(text string, res infer.Result) completionObject {
	finish := res.FinishReason
	ch := choice{FinishReason: &finish}
	kind := "text_completion"
	if c.chat {
		kind, ch.Message = "chat.completion", &message{Role: "assistant", Content: text}
		if c.req.Logprobs {
			ch.Logprobs = chatLogprobs(res.Logprobs)
		}
	} else {
		ch.Text = &text
	}
	o := c.object(kind)
	o.Choices = []choice{ch}
	u := usageOf(res)
	o.Usage = &u
	return o
}

// chunk is one streamed piece: the assistant role announcement (chat), text, or the
// final chunk carrying finish.
func (c *completion) chunk(text string, role bool, finish *string) completionObject {
	ch := choice{FinishReason: finish}
	kind := "text_completion"
	if c.chat {
		kind, ch.Delta = "chat.completion.chunk", &delta{Content: text}
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

package node

import (
	"context"
	"errors"
	"io"
	"strings"
	"sync"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/infernode/infernode/session/infer"
)

// Several choices in one answer: a text completion's list of prompts (what evaluation
// harnesses send: a batch of texts to score, echo and logprobs on, max_tokens 0 or 1),
// and n > 1 choices of one prompt. Each choice is a generation of its own, on its
// conversation's owner. A prompt's n choices share its conversation, and the engine
// shares the cells of a prompt another running request of its conversation's domain
// holds (see session's prefix sharing): so the first choice prefills the prompt, and the
// others start once it has, on its cells.

// choiceOf is one prompt of a text completion.
type choiceOf struct {
	req    infer.Request
	prompt prompt
}

// manyAtOnce bounds the generations one request runs at once: a harness's batch of 256
// must not take the engine's whole queue.
const manyAtOnce = 8

// generateMany answers c's prompts, n choices each, in one response.
func (s *Server) generateMany(ctx *fasthttp.RequestCtx, c *completion, submit submitFunc) {
	used := 0
	defer func() { c.ticket.Settle(used) }()
	if ok, _ := s.ready(); !ok {
		writeError(ctx, errNotReady)
		return
	}
	batch := c.batch
	if len(batch) == 0 { // a chat
		batch = []choiceOf{{req: c.req}}
	}
	type outcome struct {
		text, echoed string
		res          infer.Result
		err          error
	}
	out := make([]outcome, len(batch)*c.n)
	reqCtx, cancel := context.WithTimeout(s.base, s.cfg.RequestTimeout)
	defer cancel()
	reqCtx, cancelCause := context.WithCancelCause(reqCtx)
	defer cancelCause(nil)
	stopWatch := watchConn(ctx.Conn(), func() { cancelCause(errClientGone) })
	defer stopWatch()

	if s.isDraining() && !c.foreign {
		submit = s.cluster.Handoff // as generate does: the next owner serves it
	}
	run := func(i int, req infer.Request, started chan struct{}) {
		prompted := sync.OnceFunc(func() { close(started) })
		defer prompted()
		s.begin()
		defer s.end()
		select {
		case s.slots <- struct{}{}:
			defer func() { <-s.slots }()
		default:
			out[i].err = errTooManyStreams
			return
		}
		st, err := submit(reqCtx, req)
		if err != nil {
			out[i].err = err
			return
		}
		cc := *c
		cc.req = req
		// The prompt is in once the first text (or the end) comes.
		first, err := st.Recv()
		prompted()
		if err != nil && !errors.Is(err, io.EOF) {
			out[i].err = err
			return
		}
		text, res := first, st.Result()
		if err == nil {
			var rest string
			rest, res, err = s.collect(st, &cc)
			text += rest
		} else {
			err = res.Err // the end already (io.EOF): a prompt's score alone
		}
		out[i] = outcome{text: text, res: res, err: err}
		if node, _, _ := s.cluster.Route(st); node == "" && err == nil {
			s.cluster.Served(req.SessionID, s.isDraining())
		}
		out[i].echoed = s.echoed(&cc, batch[i/c.n:i/c.n+1], res)
	}

	sem := make(chan struct{}, manyAtOnce)
	var wg sync.WaitGroup
	for p, entry := range batch {
		// A prompt's first choice runs alone until its prompt is in; then its others.
		first := make(chan struct{})
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			run(p*c.n, entry.req, first)
		})
		if c.n == 1 {
			continue
		}
		<-first
		for j := 1; j < c.n; j++ {
			req := entry.req
			if req.Seed >= 0 && req.Temperature > 0 {
				req.Seed += int64(j) // the same seed would draw the same answer n times
			}
			sem <- struct{}{}
			wg.Go(func() {
				defer func() { <-sem }()
				run(p*c.n+j, req, make(chan struct{}))
			})
		}
	}
	wg.Wait()
	s.countCancel(reqCtx)
	for _, r := range out {
		used += r.res.PromptTokens + r.res.CompletionTokens
	}

	o := c.object(map[bool]string{true: "chat.completion", false: "text_completion"}[c.chat])
	var total usage
	for i, r := range out {
		if r.err == nil {
			r.err = r.res.Err
		}
		if r.err != nil {
			writeError(ctx, r.err)
			return
		}
		cc := *c
		cc.req = batch[i/c.n].req
		one := cc.response(r.text, r.echoed, r.res)
		ch := one.Choices[0]
		ch.Index = i
		o.Choices = append(o.Choices, ch)
		u := usageOf(r.res)
		total.PromptTokens += u.PromptTokens
		total.CompletionTokens += u.CompletionTokens
		total.TotalTokens += u.TotalTokens
		total.PromptTokensDetails.CachedTokens += u.PromptTokensDetails.CachedTokens
	}
	o.Usage = &total
	s.observeTTFT(c, time.Since(c.start))
	writeJSON(ctx, fasthttp.StatusOK, o)
}

// echoed is the text a text completion's choice begins with when it asked for an echo:
// its prompt as written, or for token ids, their pieces (as scored, else detokenized).
func (s *Server) echoed(c *completion, batch []choiceOf, res infer.Result) string {
	if !c.echo || len(batch) == 0 {
		return ""
	}
	p := batch[0].prompt
	if len(p.Tokens) == 0 {
		return p.Text
	}
	if len(res.PromptLogprobs) > 0 {
		var sb strings.Builder
		for _, lp := range res.PromptLogprobs {
			sb.WriteString(lp.Token)
		}
		return sb.String()
	}
	text, _ := s.engine.Detokenize(p.Tokens)
	return text
}

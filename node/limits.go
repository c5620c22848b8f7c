package node

import (
	"cmp"
	"errors"
	"strconv"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/infernode/infernode/node/quota"
	"github.com/infernode/infernode/session/infer"
)

// Tenants' rate limits (node/quota): every client request is admitted against its
// tenant's limits on its model before it is served, and its answer says where the tenant
// stands, in the headers OpenAI's SDKs read (x-ratelimit-*, and on a 429 retry-after and
// retry-after-ms, which time their retries).

// admit holds c to its tenant's limits: it keeps the ticket in c (settled as the answer
// ends) and sets the limit headers, or answers 429 and returns false.
func (s *Server) admit(ctx *fasthttp.RequestCtx, c *completion) bool {
	t, _ := s.client(ctx)
	q := s.cluster.Quota()
	name := t.limitName()
	lim := q.Limit(name, c.model)
	// The tenant's class and cache: its requests are batch work, and may be answered from
	// the response cache, whatever they ask.
	reqs := []*infer.Request{&c.req}
	for i := range c.batch {
		reqs = append(reqs, &c.batch[i].req)
	}
	for _, r := range reqs {
		r.Batch = r.Batch || lim.Batch
		r.CacheAnswer = r.CacheAnswer || lim.CacheAnswers
	}
	tokens := 0
	if lim.TPM > 0 {
		tokens = s.charge(c)
	}
	tk, err := q.Admit(ctx, name, c.model, tokens)
	if err != nil {
		writeError(ctx, err)
		var d *quota.Denied
		if errors.As(err, &d) {
			ctx.Response.Header.Set("retry-after-ms", strconv.FormatInt(max(1, d.RetryAfter.Milliseconds()), 10))
			limitHeaders(ctx, d.Status)
		}
		return false
	}
	c.ticket = tk
	limitHeaders(ctx, tk.Status)
	return true
}

// charge is what c is charged in tokens at admission: its prompts' tokens and their
// max_tokens, for every choice. What an answer does not use comes back as it ends.
func (s *Server) charge(c *completion) int {
	batch := c.batch
	if len(batch) == 0 {
		batch = []choiceOf{{req: c.req}}
	}
	total := 0
	for _, b := range batch {
		n := len(b.req.Tokens)
		if n == 0 {
			if toks, err := s.engine.Tokenize(b.req.Prompt, true); err == nil && !c.foreign {
				n = len(toks)
			} else {
				n = len(b.req.Prompt)/4 + 1 // a model served elsewhere: about 4 bytes a token
				for _, m := range b.req.Messages {
					n += len(m.Content)/4 + 1
				}
			}
		}
		most := b.req.MaxTokens
		switch {
		case b.req.PrefillOnly:
			most = 0
		case most == 0:
			most = cmp.Or(s.cfg.DefaultMaxTokens, s.cfg.MaxTokens)
		}
		total += (n + most) * max(1, c.n)
	}
	return total
}

// limitHeaders says where a tenant stands, as OpenAI does: the limit, what remains, and
// when it is full again (a duration such as "12ms"), for requests and for tokens.
func limitHeaders(ctx *fasthttp.RequestCtx, st quota.Status) {
	set := func(kind string, limit, remaining float64, reset time.Duration) {
		ctx.Response.Header.Set("x-ratelimit-limit-"+kind, strconv.FormatFloat(limit, 'f', 0, 64))
		ctx.Response.Header.Set("x-ratelimit-remaining-"+kind, strconv.FormatFloat(max(0, remaining), 'f', 0, 64))
		ctx.Response.Header.Set("x-ratelimit-reset-"+kind, reset.Round(time.Millisecond).String())
	}
	if st.Limit.RPM > 0 {
		set("requests", st.Limit.RPM, st.RemainingRequests, st.ResetRequests)
	}
	if st.Limit.TPM > 0 {
		set("tokens", st.Limit.TPM, st.RemainingTokens, st.ResetTokens)
	}
}

package node

import (
	"bytes"
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/infernode/infernode/node/hop"
	"github.com/infernode/infernode/node/quota"
	"github.com/infernode/infernode/session/infer"
)

// Errors recorded as a request context's cancellation cause.
var (
	errClientGone   = errors.New("client disconnected")
	errWriteTimeout = errors.New("client fell behind past the write timeout")
)

// completion is one parsed generation request, chat or text.
type completion struct {
	internal     bool // a request forwarded by a peer: answered in the wire format
	chat         bool
	endpoint     string
	id           string
	model        string
	stream       bool
	includeUsage bool
	followUp     bool   // a chat turn after an earlier answer: its conversation may have KV somewhere
	foreign      bool   // for a model only peers serve: routed to them, never served here
	formatted    string // the prompt formatted here from a peer's messages (see hop.NewAnswer)
	req          infer.Request
	tools        *toolPlan     // the answer is the tools' format, read back into OpenAI's shape
	resp         *responseTurn // a Responses API request's (see responses.go)
	echo         bool          // a text completion's answer begins with its prompt
	n            int           // choices a prompt (see choices.go)
	batch        []choiceOf    // a text completion's prompts (the first is req)
	ticket       *quota.Ticket // its tenant's admission (see limits.go); settled as it ends
	start        time.Time
}

// handleCompletion serves POST /v1/chat/completions (chat) and /v1/completions.
func (s *Server) handleCompletion(ctx *fasthttp.RequestCtx, chat bool) {
	c, err := s.parseCompletion(ctx, chat)
	if err != nil {
		writeError(ctx, err)
		return
	}
	if !s.admit(ctx, c) {
		return
	}
	if len(c.batch) > 1 || c.n > 1 {
		s.generateMany(ctx, c, s.submitFor(c))
		return
	}
	s.generate(ctx, c, s.submitFor(c))
}

// submitFor is where c goes: its conversation's owner, on its model's ring.
func (s *Server) submitFor(c *completion) submitFunc {
	if !c.foreign {
		return s.cluster.Submit
	}
	return func(ctx context.Context, req infer.Request) (infer.Stream, error) {
		return s.cluster.SubmitModel(ctx, c.model, req)
	}
}

// handleInternal serves a request forwarded by a peer: always here, never forwarded again
// (one hop at most, however the rings disagree). It passes the same checks as a client's.
func (s *Server) handleInternal(ctx *fasthttp.RequestCtx) {
	wire, err := s.cluster.Hop().Accept(inbound(ctx))
	if err != nil {
		writeError(ctx, err)
		return
	}
	if wire.Model != s.cfg.ModelName {
		writeError(ctx, s.unknownModel(wire.Model))
		return
	}
	c := &completion{internal: true, endpoint: hop.Path, stream: true, start: time.Now(), model: s.cfg.ModelName, req: wire.Engine()}
	if to, ok := s.cluster.Place(c.req, wire.DeclineAbove); ok {
		writeError(ctx, &hop.Error{Status: fasthttp.StatusServiceUnavailable, Type: "server_error", Code: hop.CodeDeclined,
			Message: "declined: the conversation is placed on " + to})
		ctx.Response.Header.Set(hop.HeaderPlaceTo, to) // after writeError, which resets the response
		return
	}
	if c.req.Prompt == "" && len(c.req.Messages) > 0 {
		// A chat from a node that does not serve this model: formatted here, and the
		// prompt goes back with the first text so the answer can resume elsewhere.
		if c.req.Prompt, err = s.engine.ChatPrompt(c.req.Messages); err != nil {
			writeError(ctx, err)
			return
		}
		c.formatted, c.req.Messages = c.req.Prompt, nil
	}
	if err := s.check(c.req); err != nil {
		writeError(ctx, err)
		return
	}
	s.generate(ctx, c, s.cluster.ServeLocal)
}

// inbound is a peer's request as routing authenticates it.
func inbound(ctx *fasthttp.RequestCtx) hop.Inbound {
	in := inboundHeaders(ctx)
	in.Body = ctx.PostBody()
	return in
}

// inboundHeaders is inbound without the body, for a handler that reads it itself
// (handleKV: a KV frame is read only once its headers check out).
func inboundHeaders(ctx *fasthttp.RequestCtx) hop.Inbound {
	return hop.Inbound{Method: string(ctx.Method()), Path: string(ctx.Path()),
		Header: func(name string) string { return string(ctx.Request.Header.Peek(name)) }}
}

func (s *Server) parseCompletion(ctx *fasthttp.RequestCtx, chat bool) (*completion, error) {
	if ct := ctx.Request.Header.ContentType(); !jsonContentType(ct) {
		return nil, errContentType
	}
	c := &completion{chat: chat, start: time.Now()}
	if chat {
		var r chatRequest
		if err := decodeJSON(ctx.PostBody(), &r); err != nil {
			return nil, err
		}
		c.endpoint, c.id = "/v1/chat/completions", "chatcmpl-"+randomID()
		return s.chatCompletion(ctx, c, &r)
	}
	var r completionRequest
	if err := decodeJSON(ctx.PostBody(), &r); err != nil {
		return nil, err
	}
	switch {
	case len(r.Prompt) == 0:
		return nil, badRequest("prompt", "prompt must be a non-empty string, a list of token ids, or a list of either")
	case r.Suffix != nil && *r.Suffix != "":
		return nil, unsupported("suffix")
	case r.BestOf != nil && *r.BestOf != 1:
		return nil, unsupported("best_of")
	case len(r.Tools) > 0 || r.ToolChoice != nil:
		return nil, badRequest("tools", "tools are for /v1/chat/completions")
	case r.TopLogprobs != nil:
		return nil, badRequest("top_logprobs", "on completions, logprobs is the number of alternatives (top_logprobs is chat's)")
	case r.Logprobs.Top > infer.MaxTopLogprobs:
		return nil, badRequest("logprobs", "logprobs must be at most %d", infer.MaxTopLogprobs)
	case len(r.Prompt) > 1 && r.Stream:
		return nil, badRequest("prompt", "a list of prompts is supported without stream only")
	}
	c.endpoint, c.id, c.echo = "/v1/completions", "cmpl-"+randomID(), r.Echo != nil && *r.Echo
	r.echo = c.echo
	for i, p := range r.Prompt {
		text := p.Text
		if len(p.Tokens) > 0 {
			// The ids name the conversation (its key's opening) and go to the engine as they are.
			text = strings.Trim(fmt.Sprint(p.Tokens[:min(len(p.Tokens), completionOpening)]), "[]")
		}
		switch {
		case text == "":
			return nil, badRequest("prompt", "prompt %d is empty", i)
		case strings.ContainsRune(text, 0) || strings.ContainsRune(text, '\uFDD0'):
			return nil, badRequest("prompt", "prompt %d contains a NUL byte or U+FDD0", i)
		}
		one := *c
		if _, err := s.prepare(ctx, &one, &r.params, nil, text, promptOpening(text)); err != nil {
			return nil, err
		}
		one.req.Tokens = p.Tokens
		if len(p.Tokens) > 0 && one.foreign && c.echo && !one.req.PromptLogprobs {
			// Echoed, they would be read with this node's vocabulary, not the model's.
			return nil, badRequest("echo", "echo of token ids for a model this node does not serve needs logprobs (the owner spells them)")
		}
		if i == 0 {
			*c = one
		}
		c.batch = append(c.batch, choiceOf{req: one.req, prompt: p})
	}
	return c, nil
}

// chatCompletion makes c of a chat request (or of a Responses API request, made one).
func (s *Server) chatCompletion(ctx *fasthttp.RequestCtx, c *completion, r *chatRequest) (*completion, error) {
	plan, err := r.toolPlan()
	if err != nil {
		return nil, err
	}
	// The conversation's key comes from the client's messages; the model sees them with
	// the tools' format (see withTools).
	asSent, err := withTools(r.Messages, nil)
	if err != nil {
		return nil, err
	}
	sent, err := chatMessages(asSent)
	if err != nil {
		return nil, err
	}
	forModel, err := withTools(r.Messages, plan)
	if err != nil {
		return nil, err
	}
	msgs, err := chatMessages(forModel)
	if err != nil {
		return nil, err
	}
	c.tools = plan
	c.followUp = slices.ContainsFunc(msgs, func(m infer.Message) bool { return m.Role == "assistant" })
	return s.prepare(ctx, c, &r.params, msgs, "", chatOpening(sent))
}

// prepare checks what chats and text completions share and builds c's engine request:
// from msgs for a chat, else from prompt; opening names the conversation when nothing
// else does.
func (s *Server) prepare(ctx *fasthttp.RequestCtx, c *completion, p *params, msgs []infer.Message, prompt string, opening []string) (*completion, error) {
	req, err := p.sessionRequest()
	if err != nil {
		return nil, err
	}
	if c.tools != nil {
		if req.Schema != "" {
			return nil, badRequest("response_format", "response_format and tools cannot be combined (the tools' format is the answer's)")
		}
		req.Schema = c.tools.schema
	}
	c.model = cmp.Or(p.Model, s.cfg.ModelName)
	if c.model != s.cfg.ModelName {
		if !s.cluster.Serves(c.model) {
			return nil, s.unknownModel(c.model)
		}
		c.foreign = true
	}
	switch {
	case !c.chat:
	case c.foreign: // formatted by the node that serves the model, with its template
		req.Messages = msgs
	default:
		if prompt, err = s.engine.ChatPrompt(msgs); err != nil {
			return nil, err
		}
	}
	req.Prompt, req.FollowUp = prompt, c.followUp
	if len(p.CacheSalt) > maxSessionIDLen {
		return nil, badRequest("cache_salt", "cache_salt is longer than %d bytes", maxSessionIDLen)
	}
	t, _ := s.client(ctx) // the route's guard let only a client in
	req.Share = t.share(p.CacheSalt)
	if req.SessionID, err = sessionKey(string(ctx.Request.Header.Peek("X-Session-ID")), p.SessionID, c.model,
		t.principal(s.cfg.APIKey, p.User), opening); err != nil {
		return nil, err
	}
	if err := s.check(req); err != nil {
		return nil, err
	}
	c.req, c.stream, c.n = req, p.Stream, 1
	if p.N != nil {
		c.n = *p.N
	}
	c.includeUsage = p.StreamOptions != nil && p.StreamOptions.IncludeUsage
	if p.StreamOptions != nil && !p.Stream {
		return nil, badRequest("stream_options", "stream_options is only allowed with stream: true")
	}
	return c, nil
}

func jsonContentType(ct []byte) bool {
	mt, _, _ := bytes.Cut(ct, []byte(";"))
	return strings.EqualFold(string(bytes.TrimSpace(mt)), "application/json")
}

// check is what every request must pass, a client's or a peer's: limits on its size, and
// the engine's own parameter ranges. (A request for a model only peers serve is checked
// again by the node that serves it, against that node's limits.)
func (s *Server) check(req infer.Request) error {
	switch {
	case req.MaxTokens < 0 || req.MaxTokens > s.cfg.MaxTokens:
		return badRequest("max_tokens", "max_tokens must be in [1, %d], got %d", s.cfg.MaxTokens, req.MaxTokens)
	case len(req.SessionID) > maxKeyLen:
		return badRequest("session_id", "conversation key is longer than %d bytes", maxKeyLen)
	}
	return req.Validate()
}

// generate runs c through submit and answers, streaming or not. The request is canceled
// when its client disconnects, falls behind, or the deadline passes.
func (s *Server) generate(ctx *fasthttp.RequestCtx, c *completion, submit submitFunc) {
	if ok, _ := s.ready(); !ok {
		c.ticket.Settle(0)
		writeError(ctx, errNotReady)
		return
	}
	if s.begin() {
		// Draining. A peer's hop (sent before its ring dropped this node) is served here,
		// where the conversation's cache is, and the cache moves to its next owner as the
		// answer ends (Cluster.Served); a client's request goes to the next owner from here.
		if !c.internal && !c.foreign {
			submit = s.cluster.Handoff
		}
	}
	select {
	case s.slots <- struct{}{}:
	default:
		s.end()
		c.ticket.Settle(0)
		s.log.Warn("request shed", "reason", "max streams", "limit", s.cfg.MaxStreams)
		writeError(ctx, errTooManyStreams)
		return
	}
	reqCtx, cancelDeadline := context.WithTimeout(s.base, s.cfg.RequestTimeout)
	reqCtx, cancel := context.WithCancelCause(reqCtx)
	stopWatch := watchConn(ctx.Conn(), func() { cancel(errClientGone) })
	var st infer.Stream
	done := func() {
		stopWatch()
		cancel(nil)
		cancelDeadline()
		s.countCancel(reqCtx)
		used := 0
		if st != nil {
			res := st.Result()
			used = res.PromptTokens + res.CompletionTokens
		}
		c.ticket.Settle(used)
		<-s.slots
		s.end()
	}

	st, err := submit(reqCtx, c.req)
	if err != nil {
		done()
		writeError(ctx, err)
		return
	}
	// ended runs when the answer is complete, before its last bytes go out: while this node
	// drains, a turn served here hands its conversation to its next owner before the client
	// can send the next one there; otherwise its replica starts on its way (see
	// Cluster.Served).
	ended := func() {}
	if node, _, _ := s.cluster.Route(st); node == "" {
		ended = func() {
			// A prefill-only request is a peer's, which pulls the KV itself (routing's
			// prefill and prefix pulls): no replica of it is kept warm.
			if st.Result().Err == nil && !c.req.PrefillOnly {
				s.cluster.Served(c.req.SessionID, s.isDraining())
			}
		}
	}
	if c.internal {
		s.answerHop(ctx, st, c.formatted, cancel, done, ended)
		return
	}
	if !c.stream {
		defer done()
		text, res, err := s.collect(st, c)
		if err != nil {
			writeError(ctx, err)
			return
		}
		ended()
		s.setGenerationHeaders(ctx, st)
		s.countTurn(c, st)
		if _, _, resumes := s.cluster.Route(st); resumes > 0 {
			ctx.Response.Header.Set("X-Infernode-Resumed", strconv.Itoa(resumes))
		}
		if c.resp != nil {
			o, err := s.finishResponse(c, st, text, res)
			if err != nil {
				writeError(ctx, err)
				return
			}
			writeJSON(ctx, fasthttp.StatusOK, o)
			return
		}
		writeJSON(ctx, fasthttp.StatusOK, c.response(text, s.echoed(c, c.batch, res), res))
		return
	}

	// Wait for the first text (or the end) before committing to 200, so that refusals
	// (overload, a queue timeout) still get their status and a peer can retry elsewhere.
	first, err := st.Recv()
	if err != nil && err != io.EOF {
		done()
		writeError(ctx, err)
		return
	}
	s.observeTTFT(c, time.Since(c.start))
	s.setGenerationHeaders(ctx, st)
	s.countTurn(c, st)
	s.streamBody(ctx, "text/event-stream", true, cancel, done, func(sse *sseWriter) error {
		return s.stream(sse, st, c, first, err, ended)
	})
}

// answerHop answers a peer's forwarded request in the hop's format. Its headers go with
// the first token, or once the owner's keep-alive interval has passed without one (the
// entry node then knows the owner is working); keep-alive lines follow until the first
// token. A refusal before that (overloaded, not ready) keeps its status, so the entry node
// can try the next owner.
func (s *Server) answerHop(ctx *fasthttp.RequestCtx, st infer.Stream, formatted string, cancel context.CancelCauseFunc, done, ended func()) {
	keepAlive := s.cluster.KeepAlive()
	a := hop.NewAnswer(st, formatted)
	if err := a.Wait(keepAlive); err != nil {
		a.Close()
		done()
		writeError(ctx, err)
		return
	}
	s.setGenerationHeaders(ctx, st)
	s.streamBody(ctx, "application/x-ndjson", false, cancel, done, func(w *sseWriter) error {
		return a.Write(w.data, keepAlive, toAPIError, ended)
	})
}

// streamBody commits a 200 streaming response and writes its body with write, as server
// events or as JSON lines. A failed write cancels the request: the reader is gone or too
// slow. done runs once the body has ended, or once the response is dropped unwritten.
func (s *Server) streamBody(ctx *fasthttp.RequestCtx, contentType string, sse bool, cancel context.CancelCauseFunc, done func(), write func(*sseWriter) error) {
	ctx.SetStatusCode(fasthttp.StatusOK)
	ctx.SetContentType(contentType)
	ctx.Response.Header.Set("Cache-Control", "no-cache")
	conn := ctx.Conn()
	if tc, ok := conn.(interface{ SetWriteBuffer(int) error }); ok {
		tc.SetWriteBuffer(s.cfg.StreamBuffer)
	}
	body := &eventStream{
		write: func(w io.Writer) (int64, error) {
			sw := &sseWriter{w: w, conn: conn, timeout: s.cfg.WriteTimeout, sse: sse}
			err := write(sw)
			return sw.n, err
		},
		end: func(err error) {
			defer done()
			switch {
			case err == nil:
				return
			case errors.Is(err, errWriteTimeout):
				cancel(errWriteTimeout)
			default:
				cancel(errClientGone)
			}
			s.log.Debug("stream cut", "err", err)
		},
	}
	ctx.Response.SetBodyStream(body, -1)
}

// eventStream is a streamed response body that fasthttp writes from the connection's own
// goroutine (it is a fasthttp.BodyWriterTo): each event goes to the socket as one chunk,
// flushed. SetBodyStreamWriter would put a pipe and a copying goroutine between the
// writer and the socket, one more wake-up a token on cores the engine keeps busy. Read
// serves any reader that does not write through WriteTo, by a pipe.
type eventStream struct {
	write func(io.Writer) (int64, error) // the whole body
	end   func(error)                    // once: write's error, or errClientGone if it never ran
	once  sync.Once
	pipe  *io.PipeReader
}

func (b *eventStream) SupportsBodyWriteTo() bool { return true }

func (b *eventStream) WriteTo(w io.Writer) (n int64, err error) {
	err = errBodyWritten
	b.once.Do(func() {
		n, err = b.write(w)
		b.end(err)
	})
	return n, err
}

func (b *eventStream) Read(p []byte) (int, error) {
	if b.pipe == nil {
		pr, pw := io.Pipe()
		b.pipe = pr
		go func() {
			_, err := b.WriteTo(pw)
			pw.CloseWithError(err)
		}()
	}
	return b.pipe.Read(p)
}

// Close ends a body that was never written; fasthttp calls it when it drops the response.
func (b *eventStream) Close() error {
	if b.pipe != nil {
		b.pipe.Close() // a writer blocked on the pipe fails, so once.Do below returns
	}
	b.once.Do(func() { b.end(errClientGone) })
	return nil
}

var errBodyWritten = errors.New("response body already written")

// collect reads a whole answer, observing latency metrics.
func (s *Server) collect(st infer.Stream, c *completion) (string, infer.Result, error) {
	var text []byte
	last := time.Time{}
	for {
		piece, err := st.Recv()
		if piece != "" {
			s.observePiece(c, &last)
			text = append(text, piece...)
		}
		if err != nil {
			res := st.Result()
			return string(text), res, res.Err
		}
	}
}

func (s *Server) observePiece(c *completion, last *time.Time) {
	now := time.Now()
	if last.IsZero() {
		s.observeTTFT(c, now.Sub(c.start))
	} else {
		s.observeITL(now.Sub(*last))
	}
	*last = now
}

// stream writes an SSE answer: the first piece, every later one, then the final chunk
// (and usage) and [DONE]; or an error event if generation failed. It returns a write error
// when the client is gone or too slow.
func (s *Server) stream(sse *sseWriter, st infer.Stream, c *completion, first string, firstErr error, ended func()) error {
	if c.resp != nil {
		return s.streamResponse(sse, st, c, first, firstErr, ended)
	}
	if c.chat {
		if err := sse.event(c.chunk("", true, nil)); err != nil {
			return err
		}
	}
	if e := s.echoed(c, c.batch, infer.Result{}); e != "" {
		if err := sse.event(c.chunk(e, false, nil)); err != nil {
			return err
		}
	}
	var held strings.Builder // with tools: the answer, sent in OpenAI's shape once whole
	if err := s.relay(sse, st, first, firstErr, func(piece string) error {
		if c.tools != nil {
			held.WriteString(piece)
			return nil
		}
		return sse.event(c.chunk(piece, false, nil))
	}); err != nil {
		return err
	}
	res := st.Result()
	if res.Err != nil {
		e := toAPIError(res.Err)
		s.log.Warn("stream failed", "id", c.id, "err", res.Err)
		return sse.data(e.Body())
	}
	ended()
	// The hop count, known only now that every leg has answered; headers went with the
	// first token.
	_, hops, _ := s.cluster.Route(st)
	if err := sse.comment("infernode-hops " + strconv.Itoa(hops)); err != nil {
		return err
	}
	finish := res.FinishReason
	if c.tools != nil {
		for _, ch := range c.toolChunks(held.String(), &finish) {
			if err := sse.event(ch); err != nil {
				return err
			}
		}
	}
	if err := sse.event(c.chunk("", false, &finish)); err != nil {
		return err
	}
	if c.includeUsage {
		if err := sse.event(c.usageChunk(res)); err != nil {
			return err
		}
	}
	return sse.data([]byte("[DONE]"))
}

// relay hands send every piece of st's answer, first (with firstErr) the first, until its
// end, marking each resume on another owner with an SSE comment (which OpenAI clients
// ignore, so test harnesses can tell a resumed answer from an uninterrupted one) and
// observing the gaps between pieces. It returns the first error writing.
func (s *Server) relay(sse *sseWriter, st infer.Stream, first string, firstErr error, send func(piece string) error) error {
	piece, err := first, firstErr
	last := time.Now()
	resumes := 0
	for {
		if _, _, n := s.cluster.Route(st); n > resumes {
			resumes = n
			if err := sse.comment("infernode-resumed " + strconv.Itoa(resumes)); err != nil {
				return err
			}
		}
		if piece != "" {
			if err := send(piece); err != nil {
				return err
			}
		}
		if err != nil {
			return nil
		}
		piece, err = st.Recv()
		if piece != "" {
			s.observeITL(time.Since(last))
			last = time.Now()
		}
	}
}

func (s *Server) setGenerationHeaders(ctx *fasthttp.RequestCtx, st infer.Stream) {
	prompt, cached, _ := st.Admitted()
	ctx.Response.Header.Set(hop.PromptHeader, strconv.Itoa(prompt))
	ctx.Response.Header.Set(hop.CachedHeader, strconv.Itoa(cached))
	if src := st.Source(); src != infer.Local {
		ctx.Response.Header.Set(hop.SourceHeader, string(src))
	}
	node, hops, _ := s.cluster.Route(st)
	if node != "" {
		ctx.Response.Header.Set(hop.NodeHeader, node)
	}
	ctx.Response.Header.Set(hop.HopsHeader, strconv.Itoa(hops))
}

// countTurn counts a follow-up turn as warm when the node serving it found some of its
// conversation's KV cached, cold otherwise.
func (s *Server) countTurn(c *completion, st infer.Stream) {
	if !c.followUp {
		return
	}
	cache := "cold"
	if _, cached, _ := st.Admitted(); cached > 0 {
		cache = "warm"
	}
	s.metrics.turns.WithLabelValues(cache).Inc()
}

// countCancel records why a request's context ended early, if it did.
func (s *Server) countCancel(ctx context.Context) {
	cause := context.Cause(ctx)
	switch {
	case errors.Is(cause, errClientGone):
		s.metrics.cancellations.WithLabelValues(causeClientGone).Inc()
	case errors.Is(cause, errWriteTimeout):
		s.metrics.cancellations.WithLabelValues(causeWriteTimeout).Inc()
	case errors.Is(cause, context.DeadlineExceeded):
		s.metrics.cancellations.WithLabelValues(causeDeadline).Inc()
	case s.base.Err() != nil && cause != nil:
		s.metrics.cancellations.WithLabelValues(causeShutdown).Inc()
	}
}

// sseWriter writes events (server-sent events, or JSON lines when sse is false), each in
// one write, under a fresh write deadline. A failure at or past the deadline is a write
// timeout. The deadline is left in place after the last event, so fasthttp's final writes
// (the last chunk) are bounded too; fasthttp sets a new one for the next response.
type sseWriter struct {
	sse     bool
	w       io.Writer
	conn    interface{ SetWriteDeadline(time.Time) error }
	timeout time.Duration
	buf     []byte
	n       int64 // bytes written
}

func (w *sseWriter) event(v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return w.data(b)
}

// named writes an event with its type on an event line (the Responses API's form).
func (w *sseWriter) named(typ string, b []byte) error {
	w.buf = append(append(append(append(append(w.buf[:0], "event: "...), typ...), "\ndata: "...), b...), "\n\n"...)
	return w.flush()
}

func (w *sseWriter) comment(text string) error {
	w.buf = append(append(append(w.buf[:0], ": "...), text...), "\n\n"...)
	return w.flush()
}

func (w *sseWriter) data(b []byte) error {
	w.buf = w.buf[:0]
	if w.sse {
		w.buf = append(append(append(w.buf, "data: "...), b...), "\n\n"...)
	} else {
		w.buf = append(append(w.buf, b...), '\n')
	}
	return w.flush()
}

func (w *sseWriter) flush() error {
	deadline := time.Now().Add(w.timeout)
	w.conn.SetWriteDeadline(deadline)
	n, err := w.w.Write(w.buf)
	w.n += int64(n)
	if err != nil && !time.Now().Before(deadline) {
		return errWriteTimeout
	}
	return err
}

func randomID() string {
	var b [12]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

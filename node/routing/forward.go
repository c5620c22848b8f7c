package routing

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/infernode/infernode/node/hop"
	"github.com/infernode/infernode/session/infer"
)

// Errors of the sending end. Test with errors.Is.
var (
	// ErrPeerLost: a forwarded request's owner stopped answering after it had started.
	ErrPeerLost = errors.New("owner stopped answering")
	// ErrPeerDown: this node's ring dropped the peer a forward was waiting on.
	ErrPeerDown = errors.New("peer declared down")
	// ErrHeaderTimeout: the owner sent no answer within Config.HeaderTimeout.
	ErrHeaderTimeout = errors.New("owner sent no answer in time")
	// ErrStalled: the owner sent nothing on an answer for Config.ProgressTimeout.
	ErrStalled = errors.New("owner stalled")
)

// Route says where st, a stream this router returned, is served: the node serving it now
// ("" when it is this node's engine's own), how many forwards lie behind it (the most of
// any of its legs) and how many times it moved to another owner mid-answer.
func (r *Router) Route(st infer.Stream) (node string, hops, resumes int) {
	if s, ok := st.(*routed); ok {
		return s.Node(), s.Hops(), s.resume
	}
	return "", 0, 0
}

// Submit serves req, for this node's model, on its conversation's owner: locally when
// that is this node, else forwarded. An owner that cannot be reached (refused, reset, no
// answer in time) counts a failed check and the next owner is tried; one that answers busy
// (503) is skipped without touching its health. When every candidate failed, this node
// serves the request itself (every node of a model holds the whole model, so that is
// always correct, only colder), unless it was itself busy, in which case the last busy
// answer is returned.
func (r *Router) Submit(ctx context.Context, req infer.Request) (infer.Stream, error) {
	return r.submit(ctx, target{name: r.cfg.Model}, req, nil, "")
}

// SubmitModel serves req on the owner of its conversation on model's ring: Submit for
// this node's model, and for a model only peers serve, a forward to them (with no local
// fallback). A chat for such a model comes as req.Messages, which its owner formats. It
// fails with NoModel's error (404) when no live peer serves model, and with a busy *hop.Error (503) when
// none of those that do could take the request.
func (r *Router) SubmitModel(ctx context.Context, model string, req infer.Request) (infer.Stream, error) {
	t, ok := r.v.target(model)
	if !ok {
		return nil, NoModel(model)
	}
	return r.submit(ctx, t, req, nil, "")
}

// target is a model's name and ring (see ringOf).
type target struct{ name, ring string }

func (t target) local() bool { return t.ring == "" }

// Handoff serves req on one of its owners other than this node: a draining node's way to
// pass on what still reaches it. It serves locally only when no other owner could.
func (r *Router) Handoff(ctx context.Context, req infer.Request) (infer.Stream, error) {
	return r.submit(ctx, target{name: r.cfg.Model}, req, []string{r.cfg.Self}, "")
}

// submit tries the owners of req on t's ring that are not in tried. A new request (not a
// leg of one resumed) may be placed away from its owner (see place.go).
func (r *Router) submit(ctx context.Context, t target, req infer.Request, tried []string, prefer string) (infer.Stream, error) {
	cands := r.v.candidates(t.ring, req.SessionID)
	if i := slices.IndexFunc(cands, func(c candidate) bool { return c.id == prefer && !c.full }); i > 0 {
		c := cands[i]
		cands = slices.Insert(slices.Delete(cands, i, i+1), 0, c)
	}
	decline := 0
	if len(tried) == 0 && prefer == "" {
		decline = r.placement(cands, req)
	}
	var busy error
	for i := 0; i < len(cands); i++ {
		c := cands[i]
		if slices.Contains(tried, c.id) {
			continue
		}
		if c.minor < hop.MinorFor(req) {
			// An owner that would ignore a field this request needs (a sharing domain) is
			// never chosen: the next owner, or in the end this node, serves it.
			r.forwards.WithLabelValues("incapable").Inc()
			continue
		}
		last := i == len(cands)-1
		if c.id == r.cfg.Self {
			if to, ok := r.place(i, req, decline); ok {
				// Placed on another candidate, or back here.
				r.forwards.WithLabelValues("declined").Inc()
				cands = placeNext(cands, i, to, c)
				continue
			}
			st, err := r.ServeLocal(ctx, req)
			if err == nil || !localBusy(err) {
				return st, err
			}
			busy, tried = sooner(busy, err), append(tried, c.id)
			if last {
				return nil, busy
			}
			r.forwards.WithLabelValues("spilled").Inc()
			continue
		}
		if c.full && !last {
			r.forwards.WithLabelValues("spilled").Inc()
			continue
		}
		asked := 0
		if i == 0 {
			asked = decline
		}
		st, err := r.forward(ctx, c, t.name, req, asked)
		if err == nil {
			r.forwards.WithLabelValues("ok").Inc()
			r.v.observe(c.id, true, "forward")
			return &routed{r: r, ctx: ctx, t: t, req: req, cur: st, tried: append(tried, c.id)}, nil
		}
		if ctx.Err() != nil {
			return nil, err
		}
		var remote *hop.Error
		if errors.As(err, &remote) && remote.Code == hop.CodeDeclined && asked > 0 {
			// Placed on the candidate the owner names, else back to the owner, which may
			// not decline again (a decline it was not asked for is busy, below).
			r.forwards.WithLabelValues("declined").Inc()
			cands = placeNext(cands, i, remote.PlaceTo, c)
			continue
		}
		tried = append(tried, c.id)
		switch {
		case errors.As(err, &remote) && remote.Busy():
			r.forwards.WithLabelValues("spilled").Inc()
			r.log.Debug("owner busy, trying the next one", "peer", c.id, "err", err)
			busy = sooner(busy, err)
		case errors.As(err, &remote):
			r.forwards.WithLabelValues("refused").Inc()
			return nil, err
		default:
			r.forwards.WithLabelValues("failed").Inc()
			r.log.Warn("forward failed, trying the next owner", "peer", c.id, "err", err)
			r.v.observe(c.id, false, "forward")
		}
	}
	switch {
	case !t.local() && busy != nil:
		return nil, busy
	case !t.local():
		return nil, &hop.Error{Status: http.StatusServiceUnavailable, Type: "server_error", Code: "model_unavailable", RetryAfter: 2,
			Message: fmt.Sprintf("no node serving model %q could take the request now (loading, unhealthy or unreachable)", t.name)}
	case busy != nil && slices.Contains(tried, r.cfg.Self):
		return nil, busy
	}
	return r.ServeLocal(ctx, req)
}

// sooner is the busy answer that says to retry sooner: a client refused by every candidate
// is told the earliest time any of them expects room.
func sooner(a, b error) error {
	if a == nil || retryAfter(b) < retryAfter(a) {
		return b
	}
	return a
}

// retryAfter is when a busy answer says to retry (a second when it does not say).
func retryAfter(err error) time.Duration {
	var remote *hop.Error
	var local *infer.OverloadedError
	switch {
	case errors.As(err, &remote) && remote.RetryAfter > 0:
		return time.Duration(remote.RetryAfter) * time.Second
	case errors.As(err, &local):
		return local.RetryAfter
	}
	return time.Second
}

// localBusy reports whether the local engine refused a request for now, not for good.
func localBusy(err error) bool {
	return errors.Is(err, infer.ErrOverloaded) || errors.Is(err, infer.ErrClosed)
}

// forward hands req to a peer and returns once the peer has answered with headers. The
// forward (and the stream after it) is abandoned when the client goes or when this node
// declares the peer down.
func (r *Router) forward(ctx context.Context, c candidate, model string, req infer.Request, declineAbove int) (*peerStream, error) {
	wire := hop.NewRequest(model, req)
	wire.DeclineAbove = declineAbove
	body, err := json.Marshal(wire)
	if err != nil {
		return nil, err
	}
	fctx, cancel := context.WithCancelCause(ctx)
	down := r.v.downSignal(c.id)
	go func() {
		select {
		case <-down:
			cancel(ErrPeerDown)
		case <-fctx.Done():
		}
	}()
	hreq, err := http.NewRequestWithContext(fctx, "POST", hop.URL(c.addr, hop.Path), bytes.NewReader(body))
	if err != nil {
		cancel(nil)
		return nil, fmt.Errorf("forward to %s: %w", c.id, err)
	}
	hreq.Header.Set("Content-Type", "application/json")
	r.hop.Sign(hreq.Header.Set, "POST", hop.Path, c.id, body)
	timer := r.clock.AfterFunc(r.cfg.HeaderTimeout, func() { cancel(ErrHeaderTimeout) })
	resp, err := r.client.Do(hreq)
	timer.Stop()
	if err != nil {
		if cause := context.Cause(fctx); ctx.Err() == nil && cause != nil {
			err = fmt.Errorf("%w (%v)", cause, err)
		}
		cancel(nil)
		return nil, fmt.Errorf("forward to %s: %w", c.id, err)
	}
	if resp.StatusCode != http.StatusOK {
		defer cancel(nil)
		defer resp.Body.Close()
		return nil, hop.DecodeError(resp)
	}
	cached, _ := strconv.Atoi(resp.Header.Get(hop.CachedHeader))
	prompt, _ := strconv.Atoi(resp.Header.Get(hop.PromptHeader))
	hops, _ := strconv.Atoi(resp.Header.Get(hop.HopsHeader))
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 0, 4096), r.cfg.MaxLine)
	return &peerStream{peer: c.id, node: resp.Header.Get(hop.NodeHeader), body: resp.Body, sc: sc, prompt: prompt, cached: cached,
		source: infer.Origin(resp.Header.Get(hop.SourceHeader)),
		hops:   1 + hops, ctx: fctx, cancel: cancel, clock: r.clock, progress: r.cfg.ProgressTimeout}, nil
}

// (ErrStalled), like a broken connection.
type peerStream struct {
	peer      string // the ring id it was sent to
	node      string // the node that says it serves it
	ctx       context.Context
	cancel    context.CancelCauseFunc
	clock     Clock
	progress  time.Duration
	body      io.ReadCloser
	sc        *bufio.Scanner
	prompt    int
	cached    int
	source    infer.Origin // how the owner's cached tokens came there
	hops      int          // forwards behind this answer, this one included
	formatted string       // the prompt the owner formatted from the request's messages
	tokens    int
	// The tokens the text received so far spells, the bytes of text past them, and
	// whether some text did not spell its tokens (see hop.Event.IDs).
	ids     []int32
	tail    int
	inexact bool
	texted  bool // some text came

	mu  sync.Mutex
	res infer.Result
}

func (p *peerStream) close() {
	p.body.Close()
	p.cancel(nil)
}

func (p *peerStream) lost(why error) error {
	p.close()
	if cause := context.Cause(p.ctx); cause != nil && !errors.Is(cause, context.Canceled) {
		why = fmt.Errorf("%w (%v)", cause, why)
	}
	return fmt.Errorf("%w: %s: %w", ErrPeerLost, p.peer, why)
}

// next reads the next event that is not a keep-alive, within the progress deadline.
func (p *peerStream) next() (hop.Event, error) {
	for {
		t := p.clock.AfterFunc(p.progress, func() { p.cancel(ErrStalled) })
		ok := p.sc.Scan()
		t.Stop()
		if !ok {
			err := p.sc.Err()
			if err == nil {
				err = io.ErrUnexpectedEOF
			}
			return hop.Event{}, p.lost(err)
		}
		var ev hop.Event
		if err := json.Unmarshal(p.sc.Bytes(), &ev); err != nil {
			return hop.Event{}, p.lost(fmt.Errorf("bad line: %w", err))
		}
		if ev.Error != nil && p.ctx.Err() != nil {
			// Given up on (stalled, declared down) or canceled here: the owner's error is
			// the echo of that cancellation, not its answer.
			return hop.Event{}, p.lost(context.Cause(p.ctx))
		}
		if ev.Text != "" || ev.Done != nil || ev.Error != nil {
			return ev, nil
		}
	}
}

func (p *peerStream) Recv() (string, error) {
	ev, err := p.next()
	if err != nil {
		return "", err
	}
	switch {
	case ev.Done != nil:
		p.close()
		p.mu.Lock()
		p.res = infer.Result{FinishReason: ev.Done.FinishReason, PromptTokens: ev.Done.PromptTokens,
			CachedTokens: ev.Done.CachedTokens, CompletionTokens: ev.Done.CompletionTokens, Logprobs: ev.Done.Logprobs,
			PromptLogprobs: ev.Done.PromptLogprobs, FromCache: ev.Done.FromCache}
		p.mu.Unlock()
		return "", io.EOF
	case ev.Error != nil:
		p.close()
		p.mu.Lock()
		p.res.Err = ev.Error
		p.mu.Unlock()
		return "", ev.Error
	}
	p.mu.Lock()
	p.tokens = ev.Tokens
	p.ids, p.tail, p.inexact = append(p.ids, ev.IDs...), ev.Tail, p.inexact || ev.Inexact
	p.texted = p.texted || ev.Text != ""
	if ev.Prompt > 0 {
		p.prompt, p.cached = ev.Prompt, ev.Cached
	}
	if ev.Formatted != "" {
		p.formatted = ev.Formatted
	}
	p.mu.Unlock()
	return ev.Text, nil
}

func (p *peerStream) Result() infer.Result {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.res
}

func (p *peerStream) Admitted() (int, int, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.prompt, p.cached, true
}

func (p *peerStream) Source() infer.Origin { return p.source }

func (p *peerStream) Tokens() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.tokens
}

// routed is a forwarded answer that survives its owner: when the owner stops answering
// mid-stream, it asks the next owner to continue from the prompt plus the text already
// passed on, so the client reads one uninterrupted answer. Only when no owner is left does
// it fail, with an explicit error.
type routed struct {
	r     *Router
	ctx   context.Context
	t     target
	req   infer.Request
	cur   infer.Stream
	tried []string

	text strings.Builder // passed on so far
	base int             // tokens generated by legs before cur
	// cont are the tokens of legs before cur, while every leg's text spelled its tokens
	// exactly (contLost once one did not): a resume continues from them.
	cont     []int32
	contLost bool
	// last is when the leg lastLeg last sent text (the gaps between its tokens measure
	// its owner's speed; see speed.go and the gray package).
	last    time.Time
	lastLeg *peerStream
	resume  int
	hops    int // the most forwards behind any earlier leg

	mu  sync.Mutex
	res infer.Result
}

func (s *routed) Recv() (string, error) {
	for {
		text, err := s.cur.Recv()
		s.text.WriteString(text)
		if text != "" {
			if p, ok := s.cur.(*peerStream); ok {
				now := s.r.clock.Now()
				if !s.last.IsZero() && p == s.lastLeg {
					s.r.v.speed.gap(p.peer, now.Sub(s.last))
				}
				s.last, s.lastLeg = now, p
			}
		}
		if err == nil || text != "" {
			return text, nil
		}
		var remote *hop.Error
		if errors.As(err, &remote) && remote.Busy() && s.text.Len() == 0 && s.ctx.Err() == nil {
			// Refused while queued, after the owner had sent its headers: the next owners
			// may have room, as when it is refused at once.
			st, err := s.r.submit(s.ctx, s.t, s.req, s.tried, "")
			if err != nil {
				s.finish(err)
				return "", err
			}
			s.adopt(st)
			continue
		}
		if !errors.Is(err, ErrPeerLost) || s.ctx.Err() != nil {
			s.finish(err)
			return "", err
		}
		if err := s.resumeElsewhere(err); err != nil {
			s.finish(err)
			return "", err
		}
	}
}

// resumeElsewhere continues the answer on the next owner.
func (s *routed) resumeElsewhere(cause error) error {
	peer := s.tried[len(s.tried)-1]
	s.hops = s.Hops()
	s.r.v.observe(peer, false, "stream")
	s.base += s.cur.Tokens()
	limit := s.req.MaxTokens
	if limit == 0 {
		limit = s.r.cfg.DefaultMaxTokens
	}
	cont := s.req
	if s.text.Len() > 0 && (len(cont.Tokens) > 0 || cont.PromptLogprobs) {
		return fmt.Errorf("owner %s died mid-stream, and an answer to token ids or with its prompt's logprobs does not resume: %w", peer, cause)
	}
	if cont.Prompt == "" { // a chat the dead owner formatted: continue its prompt
		p, _ := s.cur.(*peerStream)
		if p == nil || p.formatted == "" {
			if s.text.Len() > 0 {
				return fmt.Errorf("owner %s died mid-stream, and the chat's prompt it formatted is not known here: %w", peer, cause)
			}
		} else {
			cont.Prompt, cont.Messages = p.formatted, nil
		}
	}
	if ids, ok := s.continuation(); ok {
		// The answer's own tokens: the next owner goes on exactly as this one would have.
		cont.Continue = ids
	} else if s.text.Len() > 0 {
		// What the model printed is data on the next owner too: marked, so that text
		// which spells a control token is never turned into one on resume.
		cont.Prompt += infer.ContentMark + strings.ReplaceAll(s.text.String(), infer.ContentMark, "") + infer.ContentMark
		cont.Answered = s.text.String() // a schema's grammar, if any, follows it first
	}
	cont.MaxTokens = limit - s.base
	if cont.MaxTokens <= 0 { // the owner died after the last token: the answer is whole
		prompt, cached, _ := s.cur.Admitted()
		s.mu.Lock()
		// finish moves the tokens of earlier legs from the prompt to the completion.
		s.res = infer.Result{FinishReason: "length", PromptTokens: prompt + s.base, CachedTokens: cached}
		s.mu.Unlock()
		s.cur = finished{node: s.Node()}
		return nil
	}
	s.r.resumes.Inc()
	s.r.v.events.add("resume", peer, fmt.Sprintf("%d tokens in", s.base))
	s.resume++
	s.r.log.Warn("owner died mid-stream, resuming on the next owner", "peer", peer, "session", s.req.SessionID,
		"tokens_so_far", s.base, "err", cause)
	// The dead owner's heir first: its replica of the conversation holds the prompt and
	// the last turn's answer, so only the text since then is prefilled again.
	var heir string
	if s.t.local() {
		if h := s.r.v.heirs(s.req.SessionID, 1, s.tried...); len(h) > 0 {
			heir = h[0].id
		}
	}
	st, err := s.r.submit(s.ctx, s.t, cont, s.tried, heir)
	if err != nil {
		return fmt.Errorf("owner %s died mid-stream and no other owner could continue: %w", peer, err)
	}
	s.adopt(st)
	return nil
}

// continuation is the tokens the answer's text so far spells, when every leg said which
// exactly (owners of hop 1.7 and later, with text that spelled its tokens' bytes).
func (s *routed) continuation() ([]int32, bool) {
	p, _ := s.cur.(*peerStream)
	if p == nil || s.contLost {
		return nil, false
	}
	p.mu.Lock()
	ids, tail, inexact, texted := p.ids, p.tail, p.inexact, p.texted
	p.mu.Unlock()
	if tail != 0 || inexact || (texted && len(ids) == 0) { // the last: an owner before 1.7
		s.contLost = true
		return nil, false
	}
	s.cont = append(s.cont, ids...)
	return slices.Clone(s.cont), len(s.cont) > 0
}

// adopt makes st, the answer of another submit, the current leg.
func (s *routed) adopt(st infer.Stream) {
	if rs, ok := st.(*routed); ok {
		s.tried, st = rs.tried, rs.cur
	}
	s.cur = st
}

// finished is a stream at its end (a resume found the token limit already reached): node
// served all of it.
type finished struct{ node string }

func (finished) Recv() (string, error)      { return "", io.EOF }
func (finished) Result() infer.Result       { return infer.Result{} }
func (finished) Admitted() (int, int, bool) { return 0, 0, true }
func (finished) Source() infer.Origin       { return infer.Local }
func (finished) Tokens() int                { return 0 }

func (s *routed) finish(err error) {
	res := s.cur.Result()
	if _, ok := s.cur.(finished); ok {
		s.mu.Lock()
		res = s.res
		s.mu.Unlock()
	}
	if s.base > 0 {
		// Earlier legs generated base tokens; the last leg's prompt held their text.
		res.PromptTokens = max(0, res.PromptTokens-s.base)
		res.CompletionTokens += s.base
		res.Logprobs = nil // the earlier legs' went with their owners: none rather than some
	}
	if err != nil && !errors.Is(err, io.EOF) {
		res.Err = err
	}
	s.mu.Lock()
	s.res = res
	s.mu.Unlock()
}

func (s *routed) Result() infer.Result {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.res
}

func (s *routed) Admitted() (int, int, bool) { return s.cur.Admitted() }
func (s *routed) Source() infer.Origin       { return s.cur.Source() }
func (s *routed) Tokens() int                { return s.base + s.cur.Tokens() }

// Hops is the most forwards behind any leg of the answer so far.
func (s *routed) Hops() int {
	if p, ok := s.cur.(*peerStream); ok {
		return max(s.hops, p.hops)
	}
	return s.hops
}

// Node is the id of the node serving the answer now.
func (s *routed) Node() string {
	switch cur := s.cur.(type) {
	case finished:
		return cur.node
	case *peerStream:
		if cur.node != "" {
			return cur.node
		}
		return cur.peer
	}
	return s.r.cfg.Self
}

// Compile-time checks that every stream fits its roles.
var (
	_ infer.Stream = (*peerStream)(nil)
	_ infer.Stream = (*routed)(nil)
	_ infer.Stream = finished{}
)

// NoModel is the error of a request for a model no live node of the cluster serves (its
// last node left between parsing and routing): 404 model_not_found.
func NoModel(model string) *hop.Error {
	return &hop.Error{Status: http.StatusNotFound, Type: "invalid_request_error", Param: "model", Code: "model_not_found",
		Message: fmt.Sprintf("no node serves the model %q", model)}
}

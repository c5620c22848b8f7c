package node

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

	"github.com/infernode/infernode/session"
)

// This file is request routing: find the owner of a conversation on the ring, forward
// the request there, and keep the answer going when the owner dies mid-stream.

// Internal hop: the endpoint and headers one node uses to hand a request to another.
const (
	internalPath    = "/internal/v1/generate"
	hopHeader       = "X-Infernode-Hop"       // the entry node's id
	signatureHeader = "X-Infernode-Signature" // HMAC of the body with the cluster secret
	nodeHeader      = "X-Infernode-Node"
	cachedHeader    = "X-Infernode-Cached-Tokens"
)

// errPeerLost means a forwarded request's owner stopped answering after it had started.
var errPeerLost = errors.New("owner stopped answering")

// router is the Engine of a clustered node: it serves each request on its
// conversation's owner, this node included.
type router struct {
	c      *Cluster
	Engine // the local engine, for everything but Submit
}

// Engine returns the routing engine.
func (c *Cluster) Engine() Engine { return router{c: c, Engine: c.local} }

// Submit sends req to its owner: locally when that is this node, else forwarded. An owner
// that refuses or cannot be reached before answering (connection refused, timeout, 503)
// counts a failed check and the next owner is tried; when none is left, this node serves
// the request itself (every node holds the whole model, so that is always correct, only
// colder).
func (r router) Submit(ctx context.Context, req session.Request) (Stream, error) {
	return r.c.submit(ctx, req, nil)
}

// submit tries the owners of req not in tried.
func (c *Cluster) submit(ctx context.Context, req session.Request, tried []string) (Stream, error) {
	cands := c.candidates(req.SessionID)
	for i, cand := range cands {
		if slices.Contains(tried, cand.id) {
			continue
		}
		if cand.id == c.cfg.Self {
			return c.local.Submit(ctx, req)
		}
		if cand.full && i < len(cands)-1 {
			c.forwards.WithLabelValues("spilled").Inc()
			continue
		}
		st, err := c.forward(ctx, cand, req)
		if err == nil {
			c.forwards.WithLabelValues("ok").Inc()
			return &routedStream{c: c, ctx: ctx, req: req, cur: st, tried: append(tried, cand.id)}, nil
		}
		if !retryable(err) || ctx.Err() != nil {
			c.forwards.WithLabelValues("refused").Inc()
			return nil, err
		}
		c.forwards.WithLabelValues("failed").Inc()
		c.log.Warn("forward failed, trying the next owner", "peer", cand.id, "err", err)
		c.observe(cand.id, false)
		tried = append(tried, cand.id)
	}
	return c.local.Submit(ctx, req)
}

// retryable reports whether another owner may succeed where this one failed.
func retryable(err error) bool {
	var ae *apiError
	if errors.As(err, &ae) {
		return ae.Status == http.StatusServiceUnavailable
	}
	return true // transport errors: refused, reset, timed out
}

// errPeerDown cancels forwards to a peer this node's ring has dropped.
var errPeerDown = errors.New("peer declared down")

// forward hands req to a peer and returns once the peer has answered with headers. The
// forward (and the stream after it) is abandoned when the client goes or when this node
// declares the peer down.
func (c *Cluster) forward(ctx context.Context, cand candidate, req session.Request) (*peerStream, error) {
	body, err := json.Marshal(req)
	if err != nil {
		return nil, err
	}
	fctx, cancel := context.WithCancelCause(ctx)
	down := c.downSignal(cand.id)
	go func() {
		select {
		case <-down:
			cancel(errPeerDown)
		case <-fctx.Done():
		}
	}()
	hreq, err := http.NewRequestWithContext(fctx, "POST", "http://"+cand.addr+internalPath, bytes.NewReader(body))
	if err != nil {
		cancel(nil)
		return nil, err
	}
	hreq.Header.Set("Content-Type", "application/json")
	hreq.Header.Set(hopHeader, c.cfg.Self)
	if sig := c.sign(body); sig != "" {
		hreq.Header.Set(signatureHeader, sig)
	}
	if c.cfg.APIKey != "" {
		hreq.Header.Set("Authorization", "Bearer "+c.cfg.APIKey)
	}
	resp, err := c.client.Do(hreq)
	if err != nil {
		cancel(nil)
		return nil, fmt.Errorf("forward to %s: %w", cand.id, err)
	}
	if resp.StatusCode != http.StatusOK {
		defer cancel(nil)
		defer resp.Body.Close()
		return nil, decodeRemoteError(resp)
	}
	cached, _ := strconv.Atoi(resp.Header.Get(cachedHeader))
	return &peerStream{peer: resp.Header.Get(nodeHeader), body: resp.Body, r: bufio.NewReader(resp.Body), cached: cached,
		cancel: cancel}, nil
}

// decodeRemoteError rebuilds a peer's error response, so it keeps its meaning across the hop.
func decodeRemoteError(resp *http.Response) error {
	var e struct {
		Error *apiError `json:"error"`
	}
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	if json.Unmarshal(b, &e) != nil || e.Error == nil {
		return &apiError{Status: resp.StatusCode, Type: "server_error", Message: fmt.Sprintf("peer answered %d", resp.StatusCode)}
	}
	e.Error.Status = resp.StatusCode
	if ra, err := strconv.Atoi(resp.Header.Get("Retry-After")); err == nil {
		e.Error.RetryAfter = ra
	}
	return e.Error
}

// The internal stream format: one JSON object a line.
type wireEvent struct {
	Text   string    `json:"t,omitempty"`
	Tokens int       `json:"n,omitempty"` // tokens generated so far
	Done   *wireDone `json:"done,omitempty"`
	Error  *apiError `json:"error,omitempty"`
	Status int       `json:"status,omitempty"` // with Error
}

type wireDone struct {
	FinishReason     string `json:"finish_reason"`
	PromptTokens     int    `json:"prompt_tokens"`
	CachedTokens     int    `json:"cached_tokens"`
	CompletionTokens int    `json:"completion_tokens"`
}

// peerStream reads a forwarded request's answer.
type peerStream struct {
	peer   string
	cancel context.CancelCauseFunc // ends the forward's context
	body   io.ReadCloser
	r      *bufio.Reader
	cached int
	tokens int

	mu  sync.Mutex
	res session.Result
}

func (p *peerStream) close() {
	p.body.Close()
	p.cancel(nil)
}

func (p *peerStream) Recv() (string, error) {
	line, err := p.r.ReadBytes('\n')
	if err != nil {
		p.close()
		return "", fmt.Errorf("%w: %s: %v", errPeerLost, p.peer, err)
	}
	var ev wireEvent
	if err := json.Unmarshal(line, &ev); err != nil {
		p.close()
		return "", fmt.Errorf("%w: %s sent %q", errPeerLost, p.peer, line)
	}
	switch {
	case ev.Done != nil:
		p.close()
		p.mu.Lock()
		p.res = session.Result{FinishReason: ev.Done.FinishReason, PromptTokens: ev.Done.PromptTokens,
			CachedTokens: ev.Done.CachedTokens, CompletionTokens: ev.Done.CompletionTokens}
		p.mu.Unlock()
		return "", io.EOF
	case ev.Error != nil:
		p.close()
		ev.Error.Status = ev.Status
		p.mu.Lock()
		p.res.Err = ev.Error
		p.mu.Unlock()
		return "", ev.Error
	}
	p.tokens = ev.Tokens
	return ev.Text, nil
}

func (p *peerStream) Result() session.Result {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.res
}

func (p *peerStream) Admitted() (int, int, bool) { return 0, p.cached, true }
func (p *peerStream) Tokens() int                { return p.tokens }

// routedStream is a forwarded answer that survives its owner: when the owner stops
// answering mid-stream, it asks the next owner to continue from the prompt plus the text
// already passed on, so the client reads one uninterrupted answer. Only when no owner is
// left does it fail, with an explicit error.
type routedStream struct {
	c     *Cluster
	ctx   context.Context
	req   session.Request
	cur   Stream
	tried []string

	text   strings.Builder // passed on so far
	base   int             // tokens generated by legs before cur
	resume int

	mu  sync.Mutex
	res session.Result
}

func (r *routedStream) Recv() (string, error) {
	for {
		text, err := r.cur.Recv()
		r.text.WriteString(text)
		if err == nil || text != "" {
			return text, nil
		}
		if !errors.Is(err, errPeerLost) || r.ctx.Err() != nil {
			r.finish(err)
			return "", err
		}
		if err := r.resumeElsewhere(err); err != nil {
			r.finish(err)
			return "", err
		}
	}
}

// resumeElsewhere continues the answer on the next owner.
func (r *routedStream) resumeElsewhere(cause error) error {
	peer := r.tried[len(r.tried)-1]
	r.c.observe(peer, false)
	r.base += r.cur.Tokens()
	limit := r.req.MaxTokens
	if limit == 0 {
		limit = r.c.cfg.DefaultMaxTokens
	}
	cont := r.req
	cont.Prompt += r.text.String()
	cont.MaxTokens = limit - r.base
	if cont.MaxTokens <= 0 { // the owner died after the last token: the answer is whole
		r.mu.Lock()
		r.res = session.Result{FinishReason: "length"} // finish adds the tokens of earlier legs
		r.mu.Unlock()
		r.cur = finished{}
		return nil
	}
	r.c.resumes.Inc()
	r.resume++
	r.c.log.Warn("owner died mid-stream, resuming on the next owner", "peer", peer, "session", r.req.SessionID,
		"tokens_so_far", r.base, "err", cause)
	st, err := r.c.submit(r.ctx, cont, r.tried)
	if err != nil {
		return fmt.Errorf("owner %s died mid-stream and no other owner could continue: %w", peer, err)
	}
	if rs, ok := st.(*routedStream); ok {
		r.tried, st = rs.tried, rs.cur
	}
	r.cur = st
	return nil
}

// finished is a stream at its end (a resume found the token limit already reached).
type finished struct{}

func (finished) Recv() (string, error)      { return "", io.EOF }
func (finished) Result() session.Result     { return session.Result{} }
func (finished) Admitted() (int, int, bool) { return 0, 0, true }
func (finished) Tokens() int                { return 0 }

func (r *routedStream) finish(err error) {
	res := r.cur.Result()
	if _, ok := r.cur.(finished); ok {
		r.mu.Lock()
		res = r.res
		r.mu.Unlock()
	}
	if r.base > 0 {
		// Earlier legs generated base tokens; the last leg's prompt held their text.
		res.PromptTokens = max(0, res.PromptTokens-r.base)
		res.CompletionTokens += r.base
	}
	if err != nil && !errors.Is(err, io.EOF) {
		res.Err = err
	}
	r.mu.Lock()
	r.res = res
	r.mu.Unlock()
}

func (r *routedStream) Result() session.Result {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.res
}

func (r *routedStream) Admitted() (int, int, bool) { return r.cur.Admitted() }

// Resumes is how many times the answer moved to another owner mid-stream.
func (r *routedStream) Resumes() int { return r.resume }
func (r *routedStream) Tokens() int  { return r.base + r.cur.Tokens() }

// Node is the id of the node serving the answer now (the response header takes it when
// the first owner has answered).
func (r *routedStream) Node() string {
	if p, ok := r.cur.(*peerStream); ok {
		return p.peer
	}
	return r.c.cfg.Self
}

// Compile-time checks that every stream and engine fits its role.
var (
	_ Engine = (*LocalEngine)(nil)
	_ Engine = router{}
	_ Stream = (*session.Stream)(nil)
	_ Stream = (*peerStream)(nil)
	_ Stream = (*routedStream)(nil)
	_ Stream = finished{}
)

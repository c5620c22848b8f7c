package routing

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/infernode/infernode/gossip"
	"github.com/infernode/infernode/node/hop"
	"github.com/infernode/infernode/session/infer"
)

// Fakes for routing's table tests: a membership list, a clock that moves only when told,
// an in-memory network of peers (each a real receiving Router in front of a scripted
// engine), all driven synchronously by the test.

// fakeMembers is a gossip membership the test writes, as members with their Meta; it
// hands them to the router as gossip does, tags encoded and validated by the Schema.
type fakeMembers struct {
	mu      sync.Mutex
	members []member
	raw     []gossip.Member // when set, what Members returns as it is (see setRaw)
	tags    []byte
	notes   map[string][]byte // by member name: the peers' notes (see Notes)
	changes chan struct{}
}

func (f *fakeMembers) Members() []gossip.Member {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.raw != nil {
		return slices.Clone(f.raw)
	}
	var out []gossip.Member
	for _, m := range f.members {
		g := m.Member
		g.Tags, _ = m.Meta.Encode()
		if err := Schema.Validate(g.Name, g.Tags); err != nil {
			g.Invalid = err.Error()
		}
		out = append(out, g)
	}
	return out
}
func (f *fakeMembers) Changes() <-chan struct{} { return f.changes }
func (f *fakeMembers) SetTags(tags []byte) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.tags = tags
	return nil
}
func (f *fakeMembers) SetNote([]byte) error { return nil }
func (f *fakeMembers) Notes() map[string][]byte {
	f.mu.Lock()
	defer f.mu.Unlock()
	return maps.Clone(f.notes)
}
func (f *fakeMembers) Joined() bool { return true }
func (f *fakeMembers) Addr() string { return "gossip:1" }
func (f *fakeMembers) set(ms ...member) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.members, f.raw = ms, nil
}

// setRaw sets the members as gossip reports them, tags encoded by the caller.
func (f *fakeMembers) setRaw(ms []gossip.Member) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.raw = ms
}

// peerMember is a live, ready, compatible peer.
func peerMember(id string) member {
	return member{Member: gossip.Member{Name: id + "#1", Addr: id + ":7946", State: gossip.Alive},
		Meta: Meta{ID: id, HTTPAddr: id + ":80", Fingerprint: "fp", Ready: true, Hop: []int{hop.Major}}}
}

// fakeClock moves only when Advance is called.
type fakeClock struct {
	mu     sync.Mutex
	now    time.Time
	timers []*fakeTimer
}

type fakeTimer struct {
	c     *fakeClock
	at    time.Time
	f     func()
	state int // 0 pending, 1 fired, 2 stopped
}

func newFakeClock() *fakeClock { return &fakeClock{now: time.Unix(1_800_000_000, 0)} }

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) AfterFunc(d time.Duration, f func()) Timer {
	c.mu.Lock()
	defer c.mu.Unlock()
	t := &fakeTimer{c: c, at: c.now.Add(d), f: f}
	c.timers = append(c.timers, t)
	return t
}

func (t *fakeTimer) Stop() bool {
	t.c.mu.Lock()
	defer t.c.mu.Unlock()
	if t.state != 0 {
		return false
	}
	t.state = 2
	return true
}

// pendingIn is how many timers wait to fire exactly d from now.
func (c *fakeClock) pendingIn(d time.Duration) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for _, t := range c.timers {
		if t.state == 0 && t.at.Equal(c.now.Add(d)) {
			n++
		}
	}
	return n
}

// Advance moves the clock and runs the timers now due.
func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	var due []*fakeTimer
	for _, t := range c.timers {
		if t.state == 0 && !t.at.After(c.now) {
			t.state = 1
			due = append(due, t)
		}
	}
	c.mu.Unlock()
	for _, t := range due {
		t.f()
	}
}

// script says how a fake peer or engine behaves.
type script struct {
	refuse     bool          // transport: connection refused
	hang       bool          // accept the request, never answer until canceled
	busy       bool          // answer 503 overloaded
	retry      time.Duration // when busy, the Retry-After it asks for (default 1s)
	running    int           // requests its Stats report running
	waiting    int           // and waiting
	owns       bool          // Owns reports every conversation as this node's own
	holds      bool          // Holds reports every conversation held here (as a replica, unless owns)
	crashAfter int           // break the connection after this many tokens (0: never)
	stallAfter int           // after this many tokens, wait for cancellation or release (0: never)
}

// fakeEngine continues a prompt deterministically: its answer is " w0 w1 w2 ...", and a
// prompt that already ends in k such words is continued from " wk", so a resumed answer
// equals an uninterrupted one exactly.
type fakeEngine struct {
	mu       sync.Mutex
	script   script
	served   atomic.Int64
	last     atomic.Pointer[infer.Request] // the last request submitted
	canceled atomic.Int64
	started  chan struct{} // a request arrived (buffered)
	release  chan struct{} // closed: stalled streams go on
}

func newFakeEngine() *fakeEngine {
	return &fakeEngine{started: make(chan struct{}, 64), release: make(chan struct{})}
}

func (e *fakeEngine) set(s script) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.script = s
}

func (e *fakeEngine) get() script {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.script
}

func (e *fakeEngine) Submit(ctx context.Context, req infer.Request) (infer.Stream, error) {
	e.started <- struct{}{}
	e.last.Store(&req)
	s := e.get()
	switch {
	case s.busy:
		return nil, &infer.OverloadedError{Reason: "queue full", RetryAfter: cmp.Or(s.retry, time.Second)}
	case s.hang:
		<-ctx.Done()
		e.canceled.Add(1)
		return nil, fmt.Errorf("%w: %w", infer.ErrCanceled, ctx.Err())
	}
	e.served.Add(1)
	words := strings.Fields(strings.ReplaceAll(req.Prompt, infer.ContentMark, " ")) // marks delimit, as the engine tokenizes
	k := 0
	for i := len(words) - 1; i >= 0 && strings.HasPrefix(words[i], "w"); i-- {
		k++
	}
	limit := req.MaxTokens
	if limit == 0 {
		limit = 16
	}
	return &fakeStream{ctx: ctx, e: e, next: k, left: limit, prompt: len(words), stallAfter: s.stallAfter}, nil
}

func (e *fakeEngine) Stats() infer.Stats {
	s := e.get()
	return infer.Stats{Running: s.running, Waiting: s.waiting}
}
func (e *fakeEngine) Ready() bool { return true }

// The fake engine caches nothing: KV movement is tested in kvmove, and with the real engine.
func (*fakeEngine) Snapshot(context.Context, string) (infer.Frame, error) {
	return nil, infer.ErrNotCached
}
func (*fakeEngine) Import(context.Context, []byte, infer.Origin, string) (infer.Imported, error) {
	return infer.Imported{}, infer.ErrFrame
}
func (*fakeEngine) Conversations(context.Context) ([]string, error) { return nil, nil }
func (*fakeEngine) Demote(context.Context, string) error            { return nil }
func (e *fakeEngine) Holds(string) bool                             { s := e.get(); return s.holds || s.owns }
func (e *fakeEngine) Owns(string) bool                              { return e.get().owns }
func (*fakeEngine) Prefixes(context.Context, int) ([]uint64, error) { return nil, nil }

// PromptPrefixes: the fake engine's prompt is its words, each a token, blocks hashed by
// their index (as blockHashes builds them).
func (*fakeEngine) PromptPrefixes(req infer.Request) ([]int32, []uint64, error) {
	words := strings.Fields(req.Prompt)
	tokens := make([]int32, len(words))
	return tokens, blockHashes(max(0, len(words)-1) / infer.PrefixBlock), nil
}

// blockHashes are n made-up block hashes, the same for every prompt of as many blocks.
func blockHashes(n int) []uint64 {
	out := make([]uint64, n)
	for i := range out {
		out[i] = uint64(i+1) * 0x9e3779b97f4a7c15
	}
	return out
}

type fakeStream struct {
	ctx        context.Context
	e          *fakeEngine
	next       int
	left       int
	prompt     int
	n          int
	stallAfter int
	res        infer.Result
}

func (s *fakeStream) Recv() (string, error) {
	if s.stallAfter > 0 && s.n == s.stallAfter {
		select {
		case <-s.ctx.Done():
		case <-s.e.release:
		}
	}
	if err := s.ctx.Err(); err != nil {
		s.e.canceled.Add(1)
		s.res = infer.Result{Err: fmt.Errorf("%w: %w", infer.ErrCanceled, err)}
		return "", s.res.Err
	}
	if s.left == 0 {
		s.res = infer.Result{FinishReason: "length", PromptTokens: s.prompt, CompletionTokens: s.n}
		return "", io.EOF
	}
	text := fmt.Sprintf(" w%d", s.next)
	s.next++
	s.left--
	s.n++
	return text, nil
}

func (s *fakeStream) Result() infer.Result       { return s.res }
func (s *fakeStream) Admitted() (int, int, bool) { return s.prompt, 0, true }
func (s *fakeStream) Source() infer.Origin       { return infer.Local }
func (s *fakeStream) Tokens() int                { return s.n }

// memNet is an in-memory network: each address is a handler; requests and answers cross
// it through pipes, and a canceled request context breaks its answer as a closed
// connection would.
type memNet struct {
	mu    sync.Mutex
	peers map[string]http.Handler
}

func (n *memNet) add(addr string, h http.Handler) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.peers[addr] = h
}

func (n *memNet) RoundTrip(req *http.Request) (*http.Response, error) {
	n.mu.Lock()
	h := n.peers[req.URL.Host]
	n.mu.Unlock()
	if h == nil {
		return nil, &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
	}
	pr, pw := io.Pipe()
	rw := &pipeResponse{header: http.Header{}, pw: pw, ready: make(chan struct{})}
	go func() {
		h.ServeHTTP(rw, req)
		rw.WriteHeader(http.StatusOK)
		pw.Close()
	}()
	go func() {
		<-req.Context().Done()
		pr.CloseWithError(req.Context().Err())
	}()
	select {
	case <-rw.ready:
		return &http.Response{StatusCode: rw.status, Header: rw.header, Body: pr, Request: req}, nil
	case <-req.Context().Done():
		pw.CloseWithError(req.Context().Err())
		return nil, req.Context().Err()
	}
}

type pipeResponse struct {
	header http.Header
	pw     *io.PipeWriter
	status int
	once   sync.Once
	ready  chan struct{}
}

func (p *pipeResponse) Header() http.Header { return p.header }
func (p *pipeResponse) WriteHeader(status int) {
	p.once.Do(func() {
		p.status = status
		close(p.ready)
	})
}
func (p *pipeResponse) Write(b []byte) (int, error) {
	p.WriteHeader(http.StatusOK)
	return p.pw.Write(b)
}

// crash breaks the connection as a dying process would.
func (p *pipeResponse) crash() { p.pw.CloseWithError(io.ErrUnexpectedEOF) }

// peer is one fake node: a receiving Router and an engine behind the in-memory network.
type peer struct {
	id     string
	router *Router
	engine *fakeEngine

	mu       sync.Mutex
	hops     []string // each generation hop it took: the model it named, and the prompt to continue
	replicas int      // KV replicas pushed to it
}

// serveHop is the hop's receiving end as node serves it, on net/http.
func (p *peer) serveHop(w http.ResponseWriter, req *http.Request) {
	switch req.URL.Path {
	case "/readyz":
		w.WriteHeader(http.StatusOK)
		return
	case hop.ReplicaPath: // taken, as a node's engine takes a replica (kvmove tests the frames)
		io.Copy(io.Discard, req.Body)
		p.mu.Lock()
		p.replicas++
		p.mu.Unlock()
		return
	}
	s := p.engine.get()
	if s.refuse {
		panic(http.ErrAbortHandler) // never reached: refused peers are not on the network
	}
	body, _ := io.ReadAll(req.Body)
	wire, err := p.router.hop.Accept(hop.Inbound{Method: req.Method, Path: req.URL.Path, Header: req.Header.Get, Body: body})
	if err != nil {
		writeErr(w, &hop.Error{Status: http.StatusUnauthorized, Message: err.Error(), Type: "invalid_request_error"})
		return
	}
	in := wire.Engine()
	if p.router.local != nil { // a router with an engine places (see placing)
		if to, ok := p.router.Place(in, wire.DeclineAbove); ok {
			w.Header().Set(hop.HeaderPlaceTo, to)
			writeErr(w, &hop.Error{Status: 503, Message: "declined", Type: "server_error", Code: hop.CodeDeclined})
			return
		}
	}
	var formatted string
	if in.Prompt == "" { // a chat for this peer's model: formatted here, as node does
		for _, m := range in.Messages {
			formatted += m.Role + ": " + m.Content + "\n"
		}
		in.Prompt, in.Messages = formatted, nil
	}
	p.mu.Lock()
	p.hops = append(p.hops, wire.Model+": "+in.Prompt)
	p.mu.Unlock()
	st, err := p.engine.Submit(req.Context(), in)
	if err != nil {
		writeErr(w, testError(err))
		return
	}
	a := hop.NewAnswer(st, formatted)
	if err := a.Wait(p.router.cfg.KeepAlive); err != nil {
		a.Close()
		writeErr(w, testError(err))
		return
	}
	w.Header().Set(hop.NodeHeader, p.id)
	prompt, _, _ := st.Admitted()
	w.Header().Set(hop.PromptHeader, fmt.Sprint(prompt))
	w.WriteHeader(http.StatusOK)
	lines := 0
	a.Write(func(b []byte) error {
		if s.crashAfter > 0 && lines == s.crashAfter {
			w.(*pipeResponse).crash()
			return io.ErrClosedPipe
		}
		lines++
		_, err := w.Write(append(b, '\n'))
		return err
	}, p.router.cfg.KeepAlive, testError, func() {})
}

func testError(err error) *hop.Error {
	if errors.Is(err, infer.ErrOverloaded) {
		return &hop.Error{Status: 503, Message: err.Error(), Type: "server_error", Code: "overloaded", RetryAfter: int(retryAfter(err).Seconds())}
	}
	return &hop.Error{Status: 500, Message: err.Error(), Type: "server_error"}
}

func writeErr(w http.ResponseWriter, e *hop.Error) {
	w.Header().Set("Content-Type", "application/json")
	if e.RetryAfter > 0 {
		w.Header().Set("Retry-After", fmt.Sprint(e.RetryAfter))
	}
	w.WriteHeader(e.Status)
	w.Write(e.Body())
}

// cluster is an entry node "a" (the Router under test, with its own local engine) and
// peers on an in-memory network, all sharing one fake clock.
type cluster struct {
	t       *testing.T
	clock   *fakeClock
	net     *memNet
	members *fakeMembers
	entry   *Router
	local   *fakeEngine
	peers   map[string]*peer
}

var testKey = []byte("0123456789abcdef0123456789abcdef")

func testConfig(id string, clock *fakeClock, transport http.RoundTripper) Config {
	cfg := DefaultConfig()
	cfg.Self, cfg.HTTPAddr, cfg.Fingerprint, cfg.Model = id, id+":80", "fp", "m"
	cfg.Secret, cfg.DefaultMaxTokens = testKey, 16
	cfg.Clock, cfg.Transport = clock, transport
	cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	return cfg
}

// newCluster builds entry "a" and the peers named, all healthy on a's ring.
func newCluster(t *testing.T, peerIDs ...string) *cluster {
	c := &cluster{t: t, clock: newFakeClock(), net: &memNet{peers: map[string]http.Handler{}},
		members: &fakeMembers{changes: make(chan struct{}, 1)}, local: newFakeEngine(), peers: map[string]*peer{}}
	var ms []member
	for _, id := range peerIDs {
		r, err := New(testConfig(id, c.clock, c.net), &fakeMembers{changes: make(chan struct{}, 1)}, nil)
		if err != nil {
			t.Fatal(err)
		}
		p := &peer{id: id, router: r, engine: newFakeEngine()}
		c.peers[id] = p
		c.net.add(id+":80", http.HandlerFunc(p.serveHop))
		ms = append(ms, peerMember(id))
	}
	c.members.set(ms...)
	entry, err := New(testConfig("a", c.clock, c.net), c.members, c.local)
	if err != nil {
		t.Fatal(err)
	}
	c.entry = entry
	entry.Publish()
	entry.v.Sync()
	for range entry.cfg.Ring.UpAfter {
		entry.v.ProbeAll(t.Context())
	}
	if got := entry.v.table.Ring().Members(); len(got) != len(peerIDs)+1 {
		t.Fatalf("ring = %v, want a and %v", got, peerIDs)
	}
	return c
}

// keyOwnedBy finds a conversation key whose owners, in order, start with ids.
func (c *cluster) keyOwnedBy(ids ...string) string {
	for i := range 100000 {
		k := fmt.Sprint("conv-", i)
		cands := c.entry.v.candidates("", k)
		ok := len(cands) >= len(ids)
		for j := 0; ok && j < len(ids); j++ {
			ok = cands[j].id == ids[j]
		}
		if ok {
			return k
		}
	}
	c.t.Fatalf("no key owned by %v", ids)
	return ""
}

// onRing reports whether id is on the entry's ring.
func (c *cluster) onRing(id string) bool {
	return slices.Contains(c.entry.v.table.Ring().Members(), id)
}

// collect reads a stream to its end.
func collect(st infer.Stream) (string, infer.Result) {
	var b strings.Builder
	for {
		piece, err := st.Recv()
		b.WriteString(piece)
		if err != nil {
			return b.String(), st.Result()
		}
	}
}

func greedy(key, prompt string, maxTokens int) infer.Request {
	return infer.Request{SessionID: key, Prompt: prompt, MaxTokens: maxTokens, Sampling: infer.Greedy()}
}

// list is a copy of the members as the test wrote them.
func (f *fakeMembers) list() []member {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.members)
}

package node

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/infernode/infernode/gossip"
	"github.com/infernode/infernode/internal/poll"
	"github.com/infernode/infernode/node/hop"
	"github.com/infernode/infernode/node/routing"
	"github.com/infernode/infernode/session/infer"
)

// fakeEngine answers every request at once with n tokens and counts what it served: these
// tests measure and check the HTTP layer and the cluster, not inference.
type fakeEngine struct {
	n        int
	notReady bool
	frame    []byte // what Snapshot gives for every conversation, when set
	served   atomic.Int64
	last     atomic.Pointer[infer.Request]
}

func (f *fakeEngine) Submit(ctx context.Context, req infer.Request) (infer.Stream, error) {
	if f.notReady {
		return nil, infer.ErrClosed
	}
	f.served.Add(1)
	f.last.Store(&req)
	return &fakeStream{n: f.n}, nil
}
func (*fakeEngine) ChatPrompt(msgs []infer.Message) (string, error) {
	var b strings.Builder
	for _, m := range msgs {
		b.WriteString(m.Content)
	}
	return b.String(), nil
}
func (*fakeEngine) Stats() infer.Stats                     { return infer.Stats{} }
func (*fakeEngine) Tokenize(string, bool) ([]int32, error) { return nil, nil }
func (*fakeEngine) Detokenize([]int32) (string, error)     { return "", nil }
func (*fakeEngine) SeqCells() int                          { return 0 }
func (f *fakeEngine) Ready() bool                          { return !f.notReady }

// The fake engine caches nothing, unless given a frame to answer pulls with (to measure
// the transfer alone): KV hand-offs are tested with the real one.
func (f *fakeEngine) Snapshot(context.Context, string) (infer.Frame, error) {
	if f.frame == nil {
		return nil, infer.ErrNotCached
	}
	return memFrame(f.frame), nil
}
func (*fakeEngine) Import(context.Context, []byte, infer.Origin, string) (infer.Imported, error) {
	return infer.Imported{}, infer.ErrFrame
}
func (*fakeEngine) Conversations(context.Context) ([]string, error) { return nil, nil }
func (*fakeEngine) Demote(context.Context, string) error            { return nil }
func (*fakeEngine) Holds(string) bool                               { return false }
func (*fakeEngine) Owns(string) bool                                { return false }
func (*fakeEngine) Prefixes(context.Context, int) ([]uint64, error) { return nil, nil }
func (*fakeEngine) PromptPrefixes(infer.Request) ([]int32, []uint64, error) {
	return nil, nil, nil
}

// memFrame is a frame in memory.
type memFrame []byte

func (f memFrame) WriteTo(w io.Writer) (int64, error) { n, err := w.Write(f); return int64(n), err }
func (f memFrame) Len() int                           { return len(f) }
func (f memFrame) Tokens() int                        { return len(f) / 1000 }
func (f memFrame) Release()                           {}

type fakeStream struct{ n, i int }

func (s *fakeStream) Recv() (string, error) {
	if s.i < s.n {
		s.i++
		return " tok", nil
	}
	return "", io.EOF
}
func (s *fakeStream) Result() infer.Result {
	return infer.Result{FinishReason: "length", PromptTokens: 1, CompletionTokens: s.n}
}
func (s *fakeStream) Admitted() (int, int, bool) { return 1, 0, true }
func (s *fakeStream) Source() infer.Origin       { return infer.Local }
func (s *fakeStream) Tokens() int                { return s.i }

type fakeNode struct {
	url    string
	router *routing.Router
	engine *fakeEngine
	server *Server
}

// testSecret is the hop key of fake clusters.
var testSecret = []byte("0123456789abcdef0123456789abcdef")

// startFakeCluster runs n in-process nodes (real gossip, real HTTP on loopback, real
// routers) with fake engines until the test ends. A nil secret runs them insecure.
func startFakeCluster(t testing.TB, n int, secret []byte) []fakeNode {
	return startFakeClusterWith(t, n, secret, nil)
}

// startFakeClusterWith is startFakeCluster with every node's Config edited by edit.
func startFakeClusterWith(t testing.TB, n int, secret []byte, edit func(*Config)) []fakeNode {
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	var nodes []fakeNode
	var seed string
	for i := range n {
		id := fmt.Sprintf("n%d", i+1)
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		gc := gossip.DefaultConfig()
		gc.ID, gc.BindAddr, gc.BindPort, gc.Logger, gc.Schema = id, "127.0.0.1", 0, log, routing.Schema
		if seed != "" {
			gc.Join = []string{seed}
		}
		tags, _ := routing.Meta{ID: id, HTTPAddr: ln.Addr().String(), Fingerprint: "fake"}.Encode()
		g, err := gossip.New(gc, tags)
		if err != nil {
			t.Fatal(err)
		}
		engine := &fakeEngine{n: 1}
		rc := routing.DefaultConfig()
		rc.Self, rc.HTTPAddr, rc.Fingerprint, rc.Model, rc.Logger = id, ln.Addr().String(), "fake", "fake", log
		rc.Secret, rc.Insecure, rc.DefaultMaxTokens = secret, secret == nil, 16
		router, err := routing.New(rc, g, engine)
		if err != nil {
			t.Fatal(err)
		}
		nc := DefaultConfig()
		nc.ID, nc.ModelName, nc.Listener, nc.Logger, nc.MaxStreams, nc.MaxTokens = id, "fake", ln, log, 4096, 64
		if edit != nil {
			edit(&nc)
		}
		srv, err := New(nc, engine, router)
		if err != nil {
			t.Fatal(err)
		}
		go g.Run(ctx)
		go router.Run(ctx)
		go srv.Run(ctx)
		poll.Until(t, 10*time.Second, id+" gossiping", func() bool { return g.Addr() != "" })
		if seed == "" {
			seed = g.Addr()
		}
		nodes = append(nodes, fakeNode{url: "http://" + ln.Addr().String(), router: router, engine: engine, server: srv})
	}
	for _, nd := range nodes {
		poll.Until(t, 20*time.Second, "fake cluster converged", func() bool {
			v := nd.router.View(0)
			return len(v.Members) == n && !slices.ContainsFunc(v.Members, func(m routing.MemberView) bool { return !m.OnRing })
		})
	}
	return nodes
}

// ownedBy returns n X-Session-ID values whose conversations the node id owns, as entry
// sees the ring.
func ownedBy(t testing.TB, entry fakeNode, id string, n int) []string {
	var ids []string
	for i := 0; len(ids) < n; i++ {
		sid := fmt.Sprint("conv-", i)
		resp := postJSON(t, entry.url+"/v1/completions", `{"prompt":"hello","max_tokens":1}`, "X-Session-ID", sid)
		resp.Body.Close()
		if resp.Header.Get(hop.NodeHeader) == id {
			ids = append(ids, sid)
		}
		if i > 10000 {
			t.Fatalf("no conversation owned by %s", id)
		}
	}
	return ids
}

func postJSON(t testing.TB, url, body string, header ...string) *http.Response {
	t.Helper()
	req, _ := http.NewRequest("POST", url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

// handHop is a hand-made hop request, signed as a peer would sign it (or not).
type handHop struct {
	from, to, version, nonce string
	at                       time.Time
	body                     string
	key                      []byte
}

func (h handHop) send(t *testing.T, url string) (int, string) {
	t.Helper()
	if h.version == "" {
		h.version = "1.0"
	}
	if h.nonce == "" {
		h.nonce = strconv.FormatInt(time.Now().UnixNano(), 16)
		h.nonce = strings.Repeat("0", 32-len(h.nonce)) + h.nonce
	}
	if h.at.IsZero() {
		h.at = time.Now()
	}
	ts := strconv.FormatInt(h.at.UnixMilli(), 10)
	req, _ := http.NewRequest("POST", url+hop.Path, strings.NewReader(h.body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(hop.HeaderFrom, h.from)
	req.Header.Set(hop.HeaderTo, h.to)
	req.Header.Set(hop.HeaderVersion, h.version)
	req.Header.Set(hop.HeaderTime, ts)
	req.Header.Set(hop.HeaderNonce, h.nonce)
	if h.key != nil {
		sum := sha256.Sum256([]byte(h.body))
		m := hmac.New(sha256.New, h.key)
		for _, part := range []string{"infernode-hop", "POST", hop.Path, h.from, h.to, h.version, ts, h.nonce, hex.EncodeToString(sum[:])} {
			m.Write([]byte(part + "\n"))
		}
		req.Header.Set(hop.HeaderSignature, hex.EncodeToString(m.Sum(nil)))
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestHopAuthentication: only hops signed with the cluster secret, addressed to this node,
// fresh and never seen before are served; every other one gets 401 and changes nothing.
// Served hops pass the same checks as a client's request, and fields a newer minor
// version adds are ignored.
func TestHopAuthentication(t *testing.T) {
	nodes := startFakeCluster(t, 2, testSecret)
	target := nodes[1]
	body := `{"model":"fake","session_id":"k","prompt":"hello","max_tokens":1,"temperature":0,"top_p":1}`
	good := handHop{from: "n1", to: "n2", body: body, key: testSecret}
	served := func() int64 { return target.engine.served.Load() }

	if status, out := good.send(t, target.url); status != 200 || !strings.Contains(out, `"done"`) {
		t.Fatalf("signed hop: status %d body %q, want a served answer", status, out)
	}
	replay := good
	replay.nonce = "00000000000000000000000000000abc"
	if status, _ := replay.send(t, target.url); status != 200 {
		t.Fatalf("first use of a nonce: status %d", status)
	}
	before := served()
	for _, tc := range []struct {
		name string
		h    handHop
	}{
		{"unsigned", handHop{from: "n1", to: "n2", body: body}},
		{"forged", handHop{from: "n1", to: "n2", body: body, key: []byte("not-the-cluster-secret-at-all!!!")}},
		{"replayed", replay},
		{"stale", handHop{from: "n1", to: "n2", body: body, key: testSecret, at: time.Now().Add(-31 * time.Second)}},
		{"from the future", handHop{from: "n1", to: "n2", body: body, key: testSecret, at: time.Now().Add(31 * time.Second)}},
		{"for another node", handHop{from: "n1", to: "n1", body: body, key: testSecret}},
	} {
		if status, out := tc.h.send(t, target.url); status != 401 {
			t.Errorf("%s hop: status %d (%s), want 401", tc.name, status, out)
		}
	}
	if n := served() - before; n != 0 {
		t.Errorf("refused hops reached the engine %d times", n)
	}

	// A newer minor version's extra field is ignored; a newer major version is refused.
	newer := handHop{from: "n1", to: "n2", version: "1.11", key: testSecret,
		body: `{"model":"fake","session_id":"k","prompt":"hi","temperature":0,"top_p":1,"speculative":{"draft":"x"}}`}
	if status, out := newer.send(t, target.url); status != 200 {
		t.Errorf("hop with an unknown field from version 1.11: status %d (%s), want 200", status, out)
	}
	major := newer
	major.version = "2.0"
	if status, _ := major.send(t, target.url); status != 400 {
		t.Errorf("hop of major version 2: status %d, want 400", status)
	}

	// Forwarded requests pass the public checks.
	before = served()
	for _, tc := range []struct{ body, want string }{
		{`{"model":"fake","session_id":"k","prompt":"hi","max_tokens":100000,"temperature":0,"top_p":1}`, "max_tokens"},
		{`{"model":"other","session_id":"k","prompt":"hi","temperature":0,"top_p":1}`, "model"},
		{`{"model":"fake","session_id":"k","prompt":"hi","temperature":9,"top_p":1}`, "temperature"},
		{`{"model":"fake","session_id":"` + strings.Repeat("k", 400) + `","prompt":"hi","temperature":0,"top_p":1}`, "session_id"},
	} {
		h := handHop{from: "n1", to: "n2", key: testSecret, body: tc.body}
		if status, out := h.send(t, target.url); status/100 != 4 || !strings.Contains(out, tc.want) {
			t.Errorf("hop %s: status %d (%s), want a 4xx naming %s", tc.body[:min(60, len(tc.body))], status, out, tc.want)
		}
	}
	if n := served() - before; n != 0 {
		t.Errorf("invalid hops reached the engine %d times", n)
	}

	// One hop at most: a forwarded request is served where it lands, even when that node's
	// ring says another node owns the conversation.
	foreign := ownedBy(t, nodes[0], "n1", 1)[0]
	n1Before := nodes[0].engine.served.Load()
	h := handHop{from: "n1", to: "n2", key: testSecret,
		body: `{"model":"fake","session_id":"s:` + principal("", "") + `:` + foreign + `","prompt":"hi","temperature":0,"top_p":1}`}
	if status, out := h.send(t, target.url); status != 200 || nodes[0].engine.served.Load() != n1Before {
		t.Errorf("hop for a conversation n1 owns: status %d (%s), n1 served %d more, want 200 from n2 and no second hop",
			status, out, nodes[0].engine.served.Load()-n1Before)
	}

	// Through the front door, the entry node signs its own forwards.
	sid := ownedBy(t, nodes[0], "n2", 1)[0]
	resp := postJSON(t, nodes[0].url+"/v1/completions", `{"prompt":"hello","max_tokens":1}`, "X-Session-ID", sid)
	resp.Body.Close()
	if resp.StatusCode != 200 || resp.Header.Get(hop.NodeHeader) != "n2" {
		t.Errorf("forwarded request: status %d served by %q, want 200 from n2", resp.StatusCode, resp.Header.Get(hop.NodeHeader))
	}
}

// TestStandaloneHasNoHop: a node outside a cluster has no hop endpoint at all.
// A draining node passes what still reaches it to the next owner instead of refusing it,
// and tells load balancers it is not ready.
func TestDrainingNodeHandsOff(t *testing.T) {
	nodes := startFakeCluster(t, 3, testSecret)
	sids := ownedBy(t, nodes[0], "n1", 3)
	served := nodes[0].engine.served.Load()
	nodes[0].server.drain()
	for _, sid := range sids {
		resp := postJSON(t, nodes[0].url+"/v1/completions", `{"prompt":"hello","max_tokens":1}`, "X-Session-ID", sid)
		resp.Body.Close()
		if node := resp.Header.Get(hop.NodeHeader); resp.StatusCode != 200 || node == "n1" || node == "" {
			t.Errorf("draining owner answered %d, served by %q; want 200 from another owner", resp.StatusCode, node)
		}
	}
	if got := nodes[0].engine.served.Load(); got != served {
		t.Errorf("the draining node's engine served %d more requests", got-served)
	}
	resp, err := http.Get(nodes[0].url + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable {
		t.Errorf("readyz while draining = %d, want 503", resp.StatusCode)
	}
}

func TestStandaloneHasNoHop(t *testing.T) {
	url, _ := startStandalone(t, &fakeEngine{n: 1}, nil)
	status, _ := handHop{from: "x", to: "y", body: `{"prompt":"hi"}`}.send(t, url)
	if status != 404 {
		t.Errorf("hop to a standalone node: status %d, want 404", status)
	}
}

// TestPrincipals: two principals with the same conversation opening, or the same session
// id, never share a conversation key; one principal's turns share one.
func TestPrincipals(t *testing.T) {
	engine := &fakeEngine{n: 1}
	url, _ := startStandalone(t, engine, nil)
	key := func(body string, header ...string) string {
		resp := postJSON(t, url+"/v1/chat/completions", body, header...)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("status %d", resp.StatusCode)
		}
		return engine.last.Load().SessionID
	}
	msgs := `"messages":[{"role":"system","content":"s"},{"role":"user","content":"hello"}]`
	alice := key(`{` + msgs + `,"user":"alice"}`)
	bob := key(`{` + msgs + `,"user":"bob"}`)
	alice2 := key(`{` + msgs + `,"user":"alice","max_tokens":3}`)
	if alice == bob || alice != alice2 {
		t.Errorf("opening keys: alice %q, bob %q, alice again %q: want alice's turns together and bob apart", alice, bob, alice2)
	}
	a := key(`{`+msgs+`,"user":"alice"}`, "X-Session-ID", "shared")
	b := key(`{`+msgs+`,"user":"bob"}`, "X-Session-ID", "shared")
	if a == b {
		t.Errorf("session id %q is shared by two principals: %q", "shared", a)
	}
}

// TestMetricsNeedKey: with an API key, /metrics and /v1/cluster need it unless
// MetricsOpen; health probes never do.
func TestMetricsNeedKey(t *testing.T) {
	for _, open := range []bool{false, true} {
		url, _ := startStandalone(t, &fakeEngine{n: 1}, func(c *Config) { c.APIKey, c.MetricsOpen = "k", open })
		for path, want := range map[string]int{"/metrics": map[bool]int{false: 401, true: 200}[open], "/healthz": 200,
			"/readyz": 200, "/v1/cluster": 401} {
			resp, err := http.Get(url + path)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != want {
				t.Errorf("MetricsOpen %v: GET %s without the key: %d, want %d", open, path, resp.StatusCode, want)
			}
		}
	}
}

// startStandalone runs a server without a cluster in front of engine until the test ends.
func startStandalone(t testing.TB, engine Engine, edit func(*Config)) (string, *Server) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	nc := DefaultConfig()
	nc.ID, nc.ModelName, nc.Listener = "solo", "fake", ln
	nc.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	if edit != nil {
		edit(&nc)
	}
	srv, err := New(nc, engine, Standalone(engine, nc.ModelName))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return "http://" + ln.Addr().String(), srv
}

// TestNotReady: before the model is loaded, /readyz says why and generation is refused
// with 503 and Retry-After.
func TestNotReady(t *testing.T) {
	url, _ := startStandalone(t, &fakeEngine{notReady: true}, nil)
	resp, err := http.Get(url + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 503 || !strings.Contains(string(b), "model loading") {
		t.Errorf("/readyz while loading: %d %s", resp.StatusCode, b)
	}
	resp = postJSON(t, url+"/v1/completions", `{"prompt":"hi"}`)
	resp.Body.Close()
	if resp.StatusCode != 503 || resp.Header.Get("Retry-After") == "" {
		t.Errorf("completion while loading: %d, Retry-After %q", resp.StatusCode, resp.Header.Get("Retry-After"))
	}
}

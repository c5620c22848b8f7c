package node

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/infernode/infernode/node/hop"
	"github.com/infernode/infernode/session/infer"
)

// scrape returns a standalone server's /metrics text.
func scrape(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

// TestUnroutedPaths: a path the server does not route, however it is spelled (not UTF-8,
// with a body over the limit), is answered and counted under the one label "other"; it
// never becomes a metric label of its own. Before the fix, /%ff with 4 MiB + 1 byte killed
// the process: "label value "/\xff" is not valid UTF-8".
func TestUnroutedPaths(t *testing.T) {
	url, srv := startStandalone(t, &fakeEngine{n: 1}, nil)
	limit := srv.cfg.MaxBodyBytes
	for _, c := range []struct {
		path string
		body int
		want int
	}{
		{"/%ff", limit + 1, 413},
		{"/%ff", 10, 404},
		{"/%ff/%fe", 0, 404},
		{"/no/such/route", 0, 404},
		{"/v1/completions", limit + 1, 413},
		{"/v1/models/%ff", 0, 405}, // a route, for GET only
	} {
		resp, err := http.Post(url+c.path, "application/json", bytes.NewReader(make([]byte, c.body)))
		if err != nil {
			t.Fatalf("POST %s (%d bytes): %v", c.path, c.body, err)
		}
		resp.Body.Close()
		if resp.StatusCode != c.want {
			t.Errorf("POST %s (%d bytes): status %d, want %d", c.path, c.body, resp.StatusCode, c.want)
		}
	}
	text := scrape(t, url) // the node is still up
	labels := map[string]bool{}
	for _, m := range regexp.MustCompile(`infernode_http_requests_total\{endpoint="([^"]*)"`).FindAllStringSubmatch(text, -1) {
		labels[m[1]] = true
	}
	for l := range labels {
		if l != "other" && l != "/v1/completions" && l != "/v1/models/{id}" && l != "/metrics" {
			t.Errorf("endpoint label %q: only fixed labels may appear", l)
		}
	}
	if !strings.Contains(text, `infernode_http_requests_total{endpoint="other",status="413"} 1`) ||
		!strings.Contains(text, `infernode_http_requests_total{endpoint="other",status="404"} 3`) {
		t.Errorf("unrouted requests are not counted under \"other\":\n%s", matchingLines(text, "infernode_http_requests_total"))
	}
}

// panicEngine panics while formatting a chat, as a bug in any handler might.
type panicEngine struct{ fakeEngine }

func (*panicEngine) ChatPrompt([]infer.Message) (string, error) { panic("a bug") }

// TestHandlerPanic: a panic in a handler is answered 500 with an error body, counted, and
// the node keeps serving.
func TestHandlerPanic(t *testing.T) {
	url, _ := startStandalone(t, &panicEngine{fakeEngine{n: 1}}, nil)
	for range 2 {
		resp := postJSON(t, url+"/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}]}`)
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 500 || !strings.Contains(string(b), `"internal_error"`) {
			t.Errorf("panicking handler: %d %s, want 500 internal_error", resp.StatusCode, b)
		}
	}
	resp := postJSON(t, url+"/v1/completions", `{"prompt":"hi","max_tokens":1}`)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Errorf("after two panics, a completion: status %d", resp.StatusCode)
	}
	text := scrape(t, url)
	if !strings.Contains(text, "infernode_handler_panics_total 2") ||
		!strings.Contains(text, `infernode_http_requests_total{endpoint="/v1/chat/completions",status="500"} 2`) {
		t.Errorf("panics not counted:\n%s", matchingLines(text, "panics|status=\"500\""))
	}
}

func matchingLines(text, pattern string) string {
	re := regexp.MustCompile(pattern)
	var out []string
	for _, l := range strings.Split(text, "\n") {
		if re.MatchString(l) && !strings.HasPrefix(l, "#") {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// TestHostileFields: a session id that is not valid UTF-8 (it would change on the hop, and
// its owner would compute another key) and a chat of more messages than the engine's chat
// binding takes are refused with 400, and the node goes on.
func TestHostileFields(t *testing.T) {
	url, _ := startStandalone(t, &fakeEngine{n: 1}, nil)
	many := strings.Repeat(`{"role":"user","content":"x"},`, maxMessages)
	for name, c := range map[string]struct{ body, header string }{
		"session id in the body":   {body: `{"prompt":"hi","session_id":"a\xffb"}`},
		"session id in the header": {body: `{"prompt":"hi"}`, header: "a\xffb"},
		"too many messages":        {body: `{"messages":[` + many + `{"role":"user","content":"y"}]}`},
	} {
		path := "/v1/completions"
		if strings.Contains(c.body, "messages") {
			path = "/v1/chat/completions"
		}
		var resp *http.Response
		if c.header != "" {
			resp = postJSON(t, url+path, c.body, "X-Session-ID", c.header)
		} else {
			resp = postJSON(t, url+path, c.body)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 400 {
			t.Errorf("%s: %d %s, want 400", name, resp.StatusCode, b)
		}
	}
	if resp := postJSON(t, url+"/v1/completions", `{"prompt":"hi","session_id":"fine"}`); resp.StatusCode != 200 {
		t.Errorf("after the hostile fields: %d", resp.StatusCode)
	}
}

// TestKVBodyLimit: on a cluster node, a KV frame larger than an API request is read only
// when the peer's signature over the body's declared hash checks out as the headers
// arrive; the same frame with a forged signature, or without the hash, and an API request
// that large, are answered when 8 KiB of the body have come (the client sends no more
// until then), and so is a signed frame over MaxKVBytes.
func TestKVBodyLimit(t *testing.T) {
	nodes := startFakeCluster(t, 2, testSecret)
	target := nodes[1]
	body := make([]byte, 5<<20) // over the 4 MiB of an API request
	contentType := "application/octet-stream"
	// post sends the headers of body, declared size bytes long, then sent, or if it is nil
	// only body's first 8 KiB, and waits for the answer (on a connection of its own).
	post := func(path string, signer *hop.Auth, hash, blake3 bool, sent []byte, size int) int {
		t.Helper()
		h := http.Header{}
		h.Set("Content-Type", contentType)
		sum := hop.SumOf(body, blake3)
		if signer != nil {
			signer.SignHash(h.Set, "POST", path, "n2", sum)
		}
		if hash {
			h.Set(sum.Header(), sum.Hex())
		} else {
			h.Del(sum.Header())
		}
		conn, err := net.Dial("tcp", strings.TrimPrefix(target.url, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		conn.SetDeadline(time.Now().Add(10 * time.Second))
		w := bufio.NewWriter(conn)
		fmt.Fprintf(w, "POST %s HTTP/1.1\r\nHost: n2\r\nContent-Length: %d\r\n", path, size)
		h.Write(w)
		w.WriteString("\r\n")
		if sent != nil {
			w.Write(sent)
		} else {
			w.Write(body[:8<<10]) // fasthttp reads this much before it calls the handler
		}
		if err := w.Flush(); err != nil {
			t.Fatal(err)
		}
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil {
			t.Errorf("POST %s: %v (no answer before the body came)", path, err)
			return 0
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	peer := hop.NewAuth("n1", testSecret, nil, time.Now, 30*time.Second)
	forger := hop.NewAuth("n1", []byte("not the cluster secret at all!!!"), nil, time.Now, 30*time.Second)
	// The fake engine refuses every frame (400): reaching it means the body was read.
	for _, blake3 := range []bool{false, true} {
		if status := post(hop.KVPath, peer, true, blake3, body, len(body)); status != 400 {
			t.Errorf("a signed 5 MiB frame (BLAKE3 %v): status %d, want it read (400 from the fake engine)", blake3, status)
		}
	}
	// A frame whose body is not the one its signed hash declares is read, and refused.
	tampered := bytes.Clone(body)
	tampered[len(tampered)-1] ^= 1
	if status := post(hop.KVPath, peer, true, true, tampered, len(body)); status != 401 {
		t.Errorf("a signed frame's body changed: status %d, want 401", status)
	}
	for name, c := range map[string]struct {
		status int
		want   int
	}{
		"forged":                  {post(hop.KVPath, forger, true, false, nil, len(body)), 401},
		"forged, BLAKE3":          {post(hop.KVPath, forger, true, true, nil, len(body)), 401},
		"without hash":            {post(hop.ReplicaPath, peer, false, true, nil, len(body)), 401},
		"unsigned":                {post(hop.KVPath, nil, true, false, nil, len(body)), 401},
		"API":                     {post("/v1/completions", nil, false, false, nil, len(body)), 413},
		"signed, over MaxKVBytes": {post(hop.KVPath, peer, true, true, nil, target.server.cfg.MaxKVBytes+1), 413},
	} {
		if c.status != c.want {
			t.Errorf("%s, 5 MiB: status %d, want %d before the body is sent", name, c.status, c.want)
		}
	}
	// fasthttp reads a form whole before the handler, whatever its length, unless told not to.
	contentType = "multipart/form-data; boundary=x"
	if status := post("/v1/completions", nil, false, false, nil, 64<<20); status != 413 {
		t.Errorf("a 64 MiB form: status %d, want 413 before the body is sent", status)
	}
}

// TestKVSlowerThanReadTimeout: a signed KV frame that takes longer to arrive than the
// read timeout allows a request, but comes faster than the slowest link a frame is sent
// over, is read whole (before, the read timeout cut it off, and a frame over a slow link
// could never arrive).
func TestKVSlowerThanReadTimeout(t *testing.T) {
	nodes := startFakeClusterWith(t, 2, testSecret, func(c *Config) { c.ReadTimeout = 300 * time.Millisecond })
	body := make([]byte, 2<<20)
	pr, pw := io.Pipe()
	go func() { // 2 MiB in 900 ms: 2.3 MB/s, above minKVRate's 1.25
		for off := 0; off < len(body); off += 256 << 10 {
			time.Sleep(100 * time.Millisecond)
			pw.Write(body[off : off+256<<10])
		}
		pw.Close()
	}()
	req, _ := http.NewRequest("POST", nodes[1].url+hop.KVPath, pr)
	req.ContentLength = int64(len(body))
	hop.NewAuth("n1", testSecret, nil, time.Now, 30*time.Second).SignHash(req.Header.Set, "POST", hop.KVPath, "n2", hop.SumOf(body, true))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	answer, _ := io.ReadAll(resp.Body)
	// The fake engine refuses every frame it is given: reaching it means the frame was read.
	if !strings.Contains(string(answer), infer.ErrFrame.Error()) {
		t.Errorf("status %d, %s: want the fake engine's refusal (%v), the frame read whole", resp.StatusCode, answer, infer.ErrFrame)
	}
}

// TestConnCapPerIP: with a cap, an address holding that many connections has its next one
// answered 429 and closed, until one of its own closes; a cluster member is never capped.
func TestConnCapPerIP(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var peer atomic.Bool
	var refused atomic.Int64
	capped := capPerIP(ln, 2, func(netip.Addr) bool { return peer.Load() }, func() { refused.Add(1) })
	t.Cleanup(func() { capped.Close() })
	accepted := make(chan net.Conn, 8)
	go func() {
		for {
			c, err := capped.Accept()
			if err != nil {
				return
			}
			accepted <- c
		}
	}()
	dial := func() net.Conn {
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	served := func() net.Conn {
		t.Helper()
		select {
		case c := <-accepted:
			return c
		case <-time.After(5 * time.Second):
			t.Fatal("a connection within the cap was not accepted")
			return nil
		}
	}
	// refusedWith429 dials and reads the answer the cap gives.
	refusedWith429 := func() {
		t.Helper()
		c := dial()
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			t.Fatalf("a connection over the cap: %v, want a 429 answer", err)
		}
		body, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != 429 || !json.Valid(body) || !strings.Contains(string(body), "too_many_connections") {
			t.Fatalf("a connection over the cap: %d %s", resp.StatusCode, body)
		}
	}
	dial()
	first := served()
	dial()
	served()
	refusedWith429()
	if n := refused.Load(); n != 1 {
		t.Errorf("refused counted %d times, want 1", n)
	}
	first.Close() // the node closes one: its address may open another
	dial()
	served()
	peer.Store(true)
	dial()
	served()
	select {
	case c := <-accepted:
		t.Fatalf("an extra connection %v", c.RemoteAddr())
	default:
	}
}

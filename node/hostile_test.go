package node

import (
	"bytes"
	"io"
	"net/http"
	"regexp"
	"strings"
	"testing"

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

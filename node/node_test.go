//go:build cgo

// Tests of the HTTP API with the real engine (cgo): fake-engine tests are in cluster_test.go.

package node

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/infernode/infernode/internal/poll"
	"github.com/infernode/infernode/internal/testenv"
	"github.com/infernode/infernode/session"
)

// testNode is a real server with the real engine on the default model, on a loopback port.
type testNode struct {
	url    string
	addr   string
	engine *session.Engine
	srv    *Server
}

func startNode(t *testing.T, edit func(*Config, *session.Config)) *testNode {
	t.Helper()
	path := testenv.Model(t)
	log := slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelWarn}))
	ec := session.DefaultConfig()
	ec.ModelPath, ec.Cells, ec.Seed, ec.Logger = path, 4096, 1, log
	nc := DefaultConfig()
	nc.ID, nc.ModelName, nc.Logger = "test-node", "infernode-tiny", log
	if edit != nil {
		edit(&nc, &ec)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	nc.Listener = ln
	e, err := session.New(ec)
	if err != nil {
		t.Fatal(err)
	}
	local := &session.Handle{}
	local.Set(e)
	srv, err := New(nc, local, Standalone(local, nc.ModelName))
	if err != nil {
		t.Fatal(err)
	}
	engineCtx, stopEngine := context.WithCancel(context.Background())
	srvCtx, stopSrv := context.WithCancel(context.Background())
	engineDone, srvDone := make(chan error, 1), make(chan error, 1)
	go func() { engineDone <- e.Run(engineCtx) }()
	go func() { srvDone <- srv.Run(srvCtx) }()
	t.Cleanup(func() {
		stopSrv()
		if err := <-srvDone; err != nil {
			t.Errorf("server Run: %v", err)
		}
		stopEngine()
		<-engineDone
		e.Close()
	})
	n := &testNode{url: "http://" + ln.Addr().String(), addr: ln.Addr().String(), engine: e, srv: srv}
	poll.Until(t, 10*time.Second, "node ready", func() bool {
		resp, err := http.Get(n.url + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == 200
	})
	return n
}

// post sends a JSON body (see postJSON) and reads the whole answer.
func post(t *testing.T, url, body string, header ...string) (*http.Response, []byte) {
	t.Helper()
	resp := postJSON(t, url, body, header...)
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, b
}

func TestOpenAIClient(t *testing.T) {
	n := startNode(t, nil)
	client := openai.NewClient(option.WithBaseURL(n.url+"/v1/"), option.WithAPIKey("unused"), option.WithMaxRetries(0))
	ctx := t.Context()

	chat := openai.ChatCompletionNewParams{
		Model:     "infernode-tiny",
		Messages:  []openai.ChatCompletionMessageParamUnion{openai.SystemMessage("be brief"), openai.UserMessage("tell me about the river")},
		MaxTokens: openai.Int(24), Seed: openai.Int(7), Temperature: openai.Float(0.9),
		StreamOptions: openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)},
	}
	resp, err := client.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
		Model: chat.Model, Messages: chat.Messages, MaxTokens: chat.MaxTokens, Seed: chat.Seed, Temperature: chat.Temperature,
	})
	if err != nil {
		t.Fatal(err)
	}
	whole := resp.Choices[0].Message.Content
	if whole == "" || resp.Usage.CompletionTokens != 24 || resp.Choices[0].FinishReason != "length" || resp.Object != "chat.completion" {
		t.Errorf("chat completion = %+v", resp)
	}
	stream := client.Chat.Completions.NewStreaming(ctx, chat)
	var streamed strings.Builder
	var finish string
	var usage int64
	for stream.Next() {
		c := stream.Current()
		if len(c.Choices) > 0 {
			streamed.WriteString(c.Choices[0].Delta.Content)
			if c.Choices[0].FinishReason != "" {
				finish = c.Choices[0].FinishReason
			}
		}
		usage = max(usage, c.Usage.CompletionTokens)
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	if streamed.String() != whole || finish != "length" || usage != 24 {
		t.Errorf("streamed chat = %q (finish %q, usage %d), want %q (length, 24)", streamed.String(), finish, usage, whole)
	}

	comp := openai.CompletionNewParams{
		Model:     "infernode-tiny",
		Prompt:    openai.CompletionNewParamsPromptUnion{OfString: openai.String("the green forest")},
		MaxTokens: openai.Int(16), Seed: openai.Int(3), Temperature: openai.Float(0.7),
	}
	cresp, err := client.Completions.New(ctx, comp)
	if err != nil {
		t.Fatal(err)
	}
	cstream := client.Completions.NewStreaming(ctx, comp)
	var ctext strings.Builder
	for cstream.Next() {
		if c := cstream.Current(); len(c.Choices) > 0 {
			ctext.WriteString(c.Choices[0].Text)
		}
	}
	if err := cstream.Err(); err != nil {
		t.Fatal(err)
	}
	if cresp.Choices[0].Text == "" || ctext.String() != cresp.Choices[0].Text {
		t.Errorf("streamed completion %q, whole %q", ctext.String(), cresp.Choices[0].Text)
	}

	models, err := client.Models.List(ctx)
	if err != nil || len(models.Data) != 1 || models.Data[0].ID != "infernode-tiny" {
		t.Errorf("models = %+v, %v", models, err)
	}
}

func TestBadInputs(t *testing.T) {
	n := startNode(t, func(c *Config, e *session.Config) {
		c.APIKey = "secret"
		c.MaxBodyBytes = 64 << 10
		e.Cells = 1024
	})
	auth := []string{"Authorization", "Bearer secret"}
	chat := n.url + "/v1/chat/completions"
	long := strings.Repeat("the river ", 1200)
	tests := []struct {
		name        string
		method, url string
		body        string
		header      []string
		status      int
		param       string
	}{
		{"malformed json", "POST", chat, `{"messages": [`, auth, 400, ""},
		{"not an object", "POST", chat, `[1,2]`, auth, 400, ""},
		{"empty body", "POST", chat, ``, auth, 400, ""},
		{"trailing data", "POST", chat, `{"messages":[{"role":"user","content":"hi"}]} {}`, auth, 400, ""},
		{"messages wrong type", "POST", chat, `{"messages": "hi"}`, auth, 400, "messages"},
		{"max_tokens wrong type", "POST", chat, `{"messages":[{"role":"user","content":"hi"}],"max_tokens":"ten"}`, auth, 400, "max_tokens"},
		{"negative max_tokens", "POST", chat, `{"messages":[{"role":"user","content":"hi"}],"max_tokens":-1}`, auth, 400, "max_tokens"},
		{"huge max_tokens", "POST", chat, `{"messages":[{"role":"user","content":"hi"}],"max_tokens":100000000}`, auth, 400, "max_tokens"},
		{"temperature too high", "POST", chat, `{"messages":[{"role":"user","content":"hi"}],"temperature":3}`, auth, 400, "temperature"},
		{"negative temperature", "POST", chat, `{"messages":[{"role":"user","content":"hi"}],"temperature":-0.5}`, auth, 400, "temperature"},
		{"top_p zero", "POST", chat, `{"messages":[{"role":"user","content":"hi"}],"top_p":0}`, auth, 400, "top_p"},
		{"presence_penalty out of range", "POST", chat, `{"messages":[{"role":"user","content":"hi"}],"presence_penalty":9}`, auth, 400, "presence_penalty"},
		{"negative seed", "POST", chat, `{"messages":[{"role":"user","content":"hi"}],"seed":-4}`, auth, 400, "seed"},
		{"empty messages", "POST", chat, `{"messages":[]}`, auth, 400, "messages"},
		{"unknown role", "POST", chat, `{"messages":[{"role":"wizard","content":"hi"}]}`, auth, 400, "messages[0].role"},
		{"image content", "POST", chat, `{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}`, auth, 400, "messages"},
		{"n of 17", "POST", chat, `{"messages":[{"role":"user","content":"hi"}],"n":17}`, auth, 400, "n"},
		{"unknown field", "POST", chat, `{"messages":[{"role":"user","content":"hi"}],"frobnicate":true}`, auth, 400, "frobnicate"},
		{"tools", "POST", chat, `{"messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function"}]}`, auth, 400, "tools[0].function.name"},
		{"logprobs", "POST", chat, `{"messages":[{"role":"user","content":"hi"}],"logprobs":true,"stream":true}`, auth, 400, "logprobs"},
		{"stop wrong type", "POST", chat, `{"messages":[{"role":"user","content":"hi"}],"stop":5}`, auth, 400, "stop"},
		{"prompt over the context", "POST", chat, `{"messages":[{"role":"user","content":"` + long + `"}]}`, auth, 400, "messages"},
		{"completion without prompt", "POST", n.url + "/v1/completions", `{"max_tokens":3}`, auth, 400, "prompt"},
		{"completion with a token outside the vocabulary", "POST", n.url + "/v1/completions", `{"prompt":[1,2,99999999]}`, auth, 400, "prompt"},
		{"unknown model", "POST", chat, `{"model":"gpt-9","messages":[{"role":"user","content":"hi"}]}`, auth, 404, "model"},
		{"oversize body", "POST", chat, `{"messages":[{"role":"user","content":"` + strings.Repeat("x", 70<<10) + `"}]}`, auth, 413, ""},
		{"wrong method", "GET", chat, ``, auth, 405, ""},
		{"unknown route", "GET", n.url + "/v2/everything", ``, auth, 404, ""},
		{"wrong content type", "POST", chat, `{"messages":[{"role":"user","content":"hi"}]}`, []string{"Authorization", "Bearer secret", "Content-Type", "text/plain"}, 415, ""},
		{"missing api key", "POST", chat, `{"messages":[{"role":"user","content":"hi"}]}`, nil, 401, ""},
		{"wrong api key", "POST", chat, `{"messages":[{"role":"user","content":"hi"}]}`, []string{"Authorization", "Bearer guess"}, 401, ""},
		{"session id too long", "POST", chat, `{"messages":[{"role":"user","content":"hi"}]}`, []string{"Authorization", "Bearer secret", "X-Session-ID", strings.Repeat("s", 300)}, 400, "session_id"},
	}
	before := n.engine.Stats()
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req, _ := http.NewRequest(tt.method, tt.url, strings.NewReader(tt.body))
			req.Header.Set("Content-Type", "application/json")
			for i := 0; i+1 < len(tt.header); i += 2 {
				req.Header.Set(tt.header[i], tt.header[i+1])
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			var e struct {
				Error struct {
					Message string  `json:"message"`
					Type    string  `json:"type"`
					Param   *string `json:"param"`
					Code    any     `json:"code"`
				} `json:"error"`
			}
			body, _ := io.ReadAll(resp.Body)
			if err := json.Unmarshal(body, &e); err != nil || e.Error.Message == "" || e.Error.Type == "" {
				t.Fatalf("status %d, body %q: not an OpenAI error", resp.StatusCode, body)
			}
			param := ""
			if e.Error.Param != nil {
				param = *e.Error.Param
			}
			if resp.StatusCode != tt.status || param != tt.param {
				t.Errorf("status %d param %q (%s), want %d param %q", resp.StatusCode, param, e.Error.Message, tt.status, tt.param)
			}
		})
	}
	after := n.engine.Stats()
	if after.PromptTokens != before.PromptTokens || after.Running != 0 {
		t.Errorf("bad inputs reached the engine: before %+v, after %+v", before, after)
	}
	resp, body := post(t, chat, `{"messages":[{"role":"user","content":"hi"}],"max_tokens":4}`, auth...)
	if resp.StatusCode != 200 {
		t.Errorf("good request after bad ones: %d %s", resp.StatusCode, body)
	}
}

func TestCachedTokensHeader(t *testing.T) {
	n := startNode(t, nil)
	turn1 := `{"messages":[{"role":"system","content":"you are a river"},{"role":"user","content":"where do you go"}],"max_tokens":8,"temperature":0}`
	resp, body := post(t, n.url+"/v1/chat/completions", turn1)
	if resp.StatusCode != 200 || resp.Header.Get("X-Infernode-Cached-Tokens") != "0" || resp.Header.Get("X-Infernode-Node") != "test-node" {
		t.Fatalf("turn 1: %d %v %s", resp.StatusCode, resp.Header, body)
	}
	var out struct {
		Choices []struct{ Message struct{ Content string } }
	}
	json.Unmarshal(body, &out)
	answer, _ := json.Marshal(out.Choices[0].Message.Content)
	turn2 := `{"messages":[{"role":"system","content":"you are a river"},{"role":"user","content":"where do you go"},` +
		`{"role":"assistant","content":` + string(answer) + `},{"role":"user","content":"and then"}],"max_tokens":8,"stream":true}`
	resp, body = post(t, n.url+"/v1/chat/completions", turn2)
	if resp.StatusCode != 200 || resp.Header.Get("X-Infernode-Cached-Tokens") == "0" || !bytes.HasSuffix(body, []byte("data: [DONE]\n\n")) {
		t.Errorf("turn 2: %d cached %q, body %q", resp.StatusCode, resp.Header.Get("X-Infernode-Cached-Tokens"), body)
	}
}

// rawRequest sends an HTTP request over a fresh TCP connection and returns it unread.
func rawRequest(t *testing.T, addr, body string, rcvbuf int) net.Conn {
	t.Helper()
	d := net.Dialer{Control: func(_, _ string, c syscall.RawConn) error {
		if rcvbuf == 0 {
			return nil
		}
		return c.Control(func(fd uintptr) { syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, rcvbuf) })
	}}
	conn, err := d.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(conn, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	return conn
}

func TestClientDisconnect(t *testing.T) {
	n := startNode(t, func(_ *Config, e *session.Config) { e.BatchSize = 16 })
	long := strings.Repeat("the quiet river runs to the sea ", 150) // ~1,000 tokens: ~60 prefill steps
	goroutines := runtime.NumGoroutine()
	for i := range 50 {
		prefill := i%2 == 0
		body := `{"prompt":"` + long + `","max_tokens":4000,"stream":true}`
		if !prefill {
			body = `{"prompt":"the river","max_tokens":4000,"stream":true}`
		}
		conn := rawRequest(t, n.addr, body, 0)
		if prefill {
			poll.Until(t, 10*time.Second, "admission", func() bool { return n.engine.Stats().Running == 1 })
		} else {
			br := bufio.NewReader(conn)
			for line := ""; !strings.HasPrefix(line, "data:"); {
				var err error
				if line, err = br.ReadString('\n'); err != nil {
					t.Fatal(err)
				}
			}
		}
		closedAt := time.Now()
		conn.Close()
		poll.Until(t, 10*time.Second, "sequence freed", func() bool { return n.engine.Stats().Running == 0 })
		if d := time.Since(closedAt); d > time.Second {
			t.Errorf("repetition %d: sequence freed %v after disconnect, want under 1s", i, d)
		}
		if st := n.engine.Stats(); st.Generated > uint64(200*(i+1)) {
			t.Fatalf("repetition %d: %d tokens generated: disconnected clients kept generating", i, st.Generated)
		}
	}
	st := n.engine.Stats()
	// What stays is the two conversations' cache (KV of their prompts and the few tokens
	// generated before each disconnect), nothing more.
	longTokens, err := n.engine.Backend().Tokenize(long, true, false)
	if err != nil {
		t.Fatal(err)
	}
	if st.Running != 0 || st.Conversations > 2 || st.KVUsed > len(longTokens)+2*200 {
		t.Errorf("after 50 disconnects (the long prompt is %d tokens): %+v", len(longTokens), st)
	}
	poll.Until(t, 10*time.Second, "goroutines back to baseline", func() bool { return runtime.NumGoroutine() <= goroutines+5 })
	resp, _ := post(t, n.url+"/v1/completions", `{"prompt":"the sea","max_tokens":4}`)
	if resp.StatusCode != 200 {
		t.Errorf("good request after disconnects: %d", resp.StatusCode)
	}
	metrics := getMetrics(t, n)
	if !strings.Contains(metrics, `infernode_cancellations_total{cause="client_disconnect"} 50`) {
		t.Errorf("metrics do not count 50 client disconnects:\n%s", grepLines(metrics, "cancellations"))
	}
}

func getMetrics(t *testing.T, n *testNode) string {
	resp, err := http.Get(n.url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// streamITL streams a completion and returns the gaps between its text events.
func streamITL(t *testing.T, url string, tokens int) []time.Duration {
	body := fmt.Sprintf(`{"prompt":"the green garden","max_tokens":%d,"temperature":0,"stream":true}`, tokens)
	req, _ := http.NewRequest("POST", url+"/v1/completions", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Error(err)
		return nil
	}
	defer resp.Body.Close()
	var gaps []time.Duration
	last := time.Time{}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if !strings.HasPrefix(sc.Text(), "data: {") {
			continue
		}
		if !last.IsZero() {
			gaps = append(gaps, time.Since(last))
		}
		last = time.Now()
	}
	return gaps
}

func median(d []time.Duration) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	return s[len(s)/2]
}

func TestSlowReaderCutOff(t *testing.T) {
	n := startNode(t, func(c *Config, _ *session.Config) { c.WriteTimeout = 500 * time.Millisecond })
	solo := median(streamITL(t, n.url, 300))

	// A client that reads nothing, with a tiny receive buffer.
	slow := rawRequest(t, n.addr, `{"prompt":"the long story","max_tokens":8000,"stream":true,"temperature":0}`, 4096)
	defer slow.Close()
	poll.Until(t, 10*time.Second, "slow stream running", func() bool { return n.engine.Stats().Running == 1 })
	normal := median(streamITL(t, n.url, 300))
	poll.Until(t, 10*time.Second, "slow client cut off", func() bool {
		return strings.Contains(getMetrics(t, n), `infernode_cancellations_total{cause="write_timeout"} 1`)
	})
	poll.Until(t, 10*time.Second, "no running sequences", func() bool { return n.engine.Stats().Running == 0 })
	if normal > 2*solo+time.Millisecond {
		t.Errorf("normal client's median inter-token gap %v beside a stuck client, %v alone: more than 2x", normal, solo)
	}
	t.Logf("median inter-token gap: alone %v, beside a stuck client %v", solo, normal)
}

// TestAnswerOutlastsReadTimeout: the read timeout bounds reading a request, not answering
// it. fasthttp leaves the connection's read deadline set while the handler runs; the
// disconnect watch must not take the passed deadline for a client gone (it did: every
// answer, streamed or not, still running at the read timeout was canceled as
// "client disconnected").
func TestAnswerOutlastsReadTimeout(t *testing.T) {
	n := startNode(t, func(c *Config, _ *session.Config) { c.ReadTimeout = 300 * time.Millisecond })
	for _, stream := range []bool{false, true} {
		start := time.Now()
		resp, body := post(t, n.url+"/v1/completions", fmt.Sprintf(`{"prompt":"the river","max_tokens":1500,"stream":%v}`, stream))
		took := time.Since(start)
		if resp.StatusCode != 200 || strings.Contains(string(body), "error") {
			t.Fatalf("stream %v: %d after %v: %.300s", stream, resp.StatusCode, took, body)
		}
		if took < time.Second {
			t.Logf("stream %v: the answer took %v: not past the read timeout, the test proves little", stream, took)
		}
	}
}

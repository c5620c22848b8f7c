package node

import (
	"io"
	"log/slog"
	"testing"

	"github.com/valyala/fasthttp"
)

// fuzzServer is a server that is never run: the fuzz targets call its parser directly.
func fuzzServer(f *testing.F) *Server {
	cfg := DefaultConfig()
	cfg.ID, cfg.ModelName, cfg.Logger = "fuzz", "fake", slog.New(slog.NewTextHandler(io.Discard, nil))
	engine := &fakeEngine{n: 1}
	s, err := New(cfg, engine, Standalone(engine, cfg.ModelName))
	if err != nil {
		f.Fatal(err)
	}
	return s
}

// fuzzParse feeds body to the chat or completions parser: it must answer with a request
// or with a 4xx error, never panic.
func fuzzParse(f *testing.F, chat bool, seeds ...string) {
	s := fuzzServer(f)
	for _, seed := range seeds {
		f.Add([]byte(seed), "")
	}
	f.Fuzz(func(t *testing.T, body []byte, session string) {
		var ctx fasthttp.RequestCtx
		ctx.Request.Header.SetContentType("application/json")
		ctx.Request.Header.Set("X-Session-ID", session)
		ctx.Request.SetBody(body)
		c, err := s.parseCompletion(&ctx, chat)
		if err != nil {
			if e := toAPIError(err); e.Status < 400 || e.Status > 499 {
				t.Fatalf("%q: %v (%d), want a 4xx error", body, err, e.Status)
			}
			return
		}
		if c.req.SessionID == "" || len(c.req.SessionID) > maxKeyLen {
			t.Fatalf("%q: conversation key %q", body, c.req.SessionID)
		}
	})
}

func FuzzChatRequest(f *testing.F) {
	fuzzParse(f, true,
		`{"messages":[{"role":"user","content":"hi"}]}`,
		`{"messages":[{"role":"system","content":"s"},{"role":"user","content":[{"type":"text","text":"x"}]}],"max_tokens":3,"stop":["a","b"],"user":"u","cache_salt":"s"}`,
		`{"messages":[{"role":"assistant","content":null},{"role":"user","content":"a\u0000b"}],"temperature":2.5,"top_p":0}`,
		`{"model":"other","messages":[{"role":"tool","content":"x"}],"n":2,"logprobs":true,"top_logprobs":30}`,
		`{"messages":[]}`, `[]`, `{"messages":[{"role":"user","content":"x"}]} {}`)
}

func FuzzCompletionRequest(f *testing.F) {
	fuzzParse(f, false,
		`{"prompt":"once upon a time","max_tokens":16,"temperature":0}`,
		`{"prompt":["a"],"stream":true,"stream_options":{"include_usage":true},"session_id":"s1"}`,
		`{"prompt":"","seed":-1,"frequency_penalty":3}`,
		`{"prompt":"x","max_tokens":-1,"stop":"\n"}`, `{"prompt":1}`, `null`)
}

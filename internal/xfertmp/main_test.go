package xfer

import (
	"bytes"
	"io"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/valyala/fasthttp"
)

func TestXfer(t *testing.T) {
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	var handlerAt time.Time
	srv := &fasthttp.Server{Handler: func(ctx *fasthttp.RequestCtx) { handlerAt = time.Now(); _ = len(ctx.PostBody()) }, MaxRequestBodySize: 64 << 20,
		HeaderReceived: func(h *fasthttp.RequestHeader) fasthttp.RequestConfig { return fasthttp.RequestConfig{MaxRequestBodySize: 64 << 20} }}
	go srv.Serve(ln)
	data := make([]byte, 27<<20)
	for _, ka := range []bool{true, false} {
		client := &http.Client{Transport: &http.Transport{DisableKeepAlives: !ka}}
		for i := 0; i < 4; i++ {
			start := time.Now()
			req, _ := http.NewRequest("POST", "http://"+ln.Addr().String()+"/kv", bytes.NewReader(data))
			req.ContentLength = int64(len(data))
			resp, err := client.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			d := time.Since(start)
			t.Logf("keepalive=%v %v (handler at %v) %.0f MB/s", ka, d, handlerAt.Sub(start), float64(len(data))/d.Seconds()/1e6)
			time.Sleep(2 * time.Second)
		}
	}
}

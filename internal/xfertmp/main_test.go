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
	srv := &fasthttp.Server{Handler: func(ctx *fasthttp.RequestCtx) { _ = len(ctx.PostBody()) }, MaxRequestBodySize: 64 << 20,
		HeaderReceived: func(h *fasthttp.RequestHeader) fasthttp.RequestConfig { return fasthttp.RequestConfig{MaxRequestBodySize: 64 << 20} }}
	go srv.Serve(ln)
	data := make([]byte, 27<<20)
	client := &http.Client{Transport: &http.Transport{}}
	for _, pipe := range []bool{true, false, true, false} {
		start := time.Now()
		var body io.Reader = bytes.NewReader(data)
		if pipe {
			pr, pw := io.Pipe()
			go func() { pw.Write(data); pw.Close() }()
			body = pr
		}
		req, _ := http.NewRequest("POST", "http://"+ln.Addr().String()+"/kv", body)
		req.ContentLength = int64(len(data))
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		d := time.Since(start)
		t.Logf("pipe=%v %v %.0f MB/s", pipe, d, float64(len(data))/d.Seconds()/1e6)
	}
}

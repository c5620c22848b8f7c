package node

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"slices"
	"testing"
	"time"

	"github.com/valyala/fasthttp"
	"github.com/valyala/fasthttp/fasthttputil"
)

type noDeadline struct{}

func (noDeadline) SetWriteDeadline(time.Time) error { return nil }

// testBody streams n JSON lines; end records what eventStream reports.
func testBody(n int, ended *[]error) *eventStream {
	return &eventStream{
		write: func(w io.Writer) (int64, error) {
			sw := &sseWriter{w: w, conn: noDeadline{}, timeout: time.Second}
			for i := range n {
				if err := sw.data([]byte{'0' + byte(i)}); err != nil {
					return sw.n, err
				}
			}
			return sw.n, nil
		},
		end: func(err error) { *ended = append(*ended, err) },
	}
}

// endedOnce fails t unless end was called exactly once, with want (errors.Is; nil: nil).
func endedOnce(t *testing.T, ended []error, want error) {
	t.Helper()
	if len(ended) != 1 || !errors.Is(ended[0], want) {
		t.Errorf("end called with %v, want once with %v", ended, want)
	}
}

func TestEventStream(t *testing.T) {
	t.Run("WriteTo", func(t *testing.T) {
		var ended []error
		b := testBody(3, &ended)
		var out bytes.Buffer
		n, err := b.WriteTo(&out)
		if err != nil || out.String() != "0\n1\n2\n" || n != 6 {
			t.Fatalf("WriteTo = %d, %v, body %q; want 6, nil, %q", n, err, out.String(), "0\n1\n2\n")
		}
		if _, err := b.WriteTo(&out); !errors.Is(err, errBodyWritten) {
			t.Errorf("second WriteTo: %v, want %v", err, errBodyWritten)
		}
		b.Close()
		endedOnce(t, ended, nil)
	})
	t.Run("Read", func(t *testing.T) {
		var ended []error
		b := testBody(3, &ended)
		got, err := io.ReadAll(b)
		if err != nil || string(got) != "0\n1\n2\n" {
			t.Fatalf("ReadAll = %q, %v", got, err)
		}
		b.Close()
		endedOnce(t, ended, nil)
	})
	t.Run("closed unwritten", func(t *testing.T) {
		var ended []error
		b := testBody(3, &ended)
		b.Close()
		endedOnce(t, ended, errClientGone)
	})
	t.Run("closed mid-read", func(t *testing.T) {
		var ended []error
		b := testBody(100, &ended)
		if _, err := io.ReadFull(b, make([]byte, 4)); err != nil {
			t.Fatal(err)
		}
		b.Close() // returns only once the writer has stopped
		endedOnce(t, ended, io.ErrClosedPipe)
	})
	t.Run("served", func(t *testing.T) {
		// fasthttp writes it through WriteTo, on its own goroutine: no pipe.
		ln := fasthttputil.NewInmemoryListener()
		defer ln.Close()
		bodies := make(chan *eventStream, 1)
		ended := make(chan error, 1)
		go fasthttp.Serve(ln, func(ctx *fasthttp.RequestCtx) {
			var errs []error
			b := testBody(3, &errs)
			end := b.end
			b.end = func(err error) { end(err); ended <- err }
			ctx.Response.SetBodyStream(b, -1)
			bodies <- b
		})
		c := http.Client{Transport: &http.Transport{DialContext: func(context.Context, string, string) (net.Conn, error) { return ln.Dial() }}}
		resp, err := c.Get("http://node/")
		if err != nil {
			t.Fatal(err)
		}
		got, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil || string(got) != "0\n1\n2\n" || !slices.Equal(resp.TransferEncoding, []string{"chunked"}) {
			t.Fatalf("body %q (%v), transfer encoding %v", got, err, resp.TransferEncoding)
		}
		if err := <-ended; err != nil {
			t.Errorf("end called with %v", err)
		}
		if b := <-bodies; b.pipe != nil {
			t.Error("fasthttp read the body through Read, not WriteTo")
		}
	})
}

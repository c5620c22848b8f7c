package node

import (
	"errors"
	"testing"

	"github.com/infernode/infernode/node/hop"
	"github.com/infernode/infernode/session/infer"
)

// TestGoldenErrorBodies: the error bodies clients and peers read, byte for byte, written
// down before any move of the code that makes them (see routing's golden tests).
func TestGoldenErrorBodies(t *testing.T) {
	for _, c := range []struct {
		err  error
		want string
	}{
		{errBodyTooLarge, `{"error":{"message":"request body is larger than this node accepts","type":"invalid_request_error","param":null,"code":"request_too_large"}}`},
		{badRequest("max_tokens", "max_tokens must be at least 1"), `{"error":{"message":"max_tokens must be at least 1","type":"invalid_request_error","param":"max_tokens","code":null}}`},
		{&hop.Error{Status: 503, Message: "busy", Type: "server_error", Code: "overloaded", RetryAfter: 2},
			`{"error":{"message":"busy","type":"server_error","param":null,"code":"overloaded"}}`},
		{infer.ErrClosed, `{"error":{"message":"this node is not ready to serve (loading the model or shutting down)","type":"server_error","param":null,"code":"not_ready"}}`},
		{errors.New("boom"), `{"error":{"message":"boom","type":"server_error","param":null,"code":"internal_error"}}`},
	} {
		if got := string(toAPIError(c.err).Body()); got != c.want {
			t.Errorf("error body of %v:\n got %s\nwant %s", c.err, got, c.want)
		}
	}
	h := toAPIError(&infer.OverloadedError{})
	if h.Status != 503 || h.RetryAfter != 1 || h.Code != "overloaded" {
		t.Errorf("overloaded across the hop: %+v", h)
	}
}

package node

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"

	"github.com/valyala/fasthttp"

	"github.com/infernode/infernode/node/hop"
	"github.com/infernode/infernode/node/quota"
	"github.com/infernode/infernode/session/infer"
)

func badRequest(param, format string, args ...any) *hop.Error {
	return &hop.Error{Status: fasthttp.StatusBadRequest, Type: "invalid_request_error", Param: nullable(param),
		Message: fmt.Sprintf(format, args...)}
}

func unsupported(param string) *hop.Error {
	e := badRequest(param, "parameter %q is not supported by infernode", param)
	e.Code = "unsupported_parameter"
	return e
}

func nullable(s string) any {
	if s == "" {
		return nil
	}
	return s
}

// Errors of the HTTP layer itself.
var (
	errStandalone = &hop.Error{Status: fasthttp.StatusNotFound, Type: "invalid_request_error", Code: "not_clustered",
		Message: "this node runs standalone (no --gossip-addr)"}
	errNotFound = &hop.Error{Status: fasthttp.StatusNotFound, Type: "invalid_request_error", Code: "not_found",
		Message: "no such route"}
	errUnauthorized = &hop.Error{Status: fasthttp.StatusUnauthorized, Type: "invalid_request_error", Code: "invalid_api_key",
		Message: "missing or wrong API key: send Authorization: Bearer <key>"}
	errBodyTooLarge = &hop.Error{Status: fasthttp.StatusRequestEntityTooLarge, Type: "invalid_request_error",
		Code: "request_too_large", Message: "request body is larger than this node accepts"}
	errContentType = &hop.Error{Status: fasthttp.StatusUnsupportedMediaType, Type: "invalid_request_error",
		Code: "unsupported_media_type", Message: "Content-Type must be application/json"}
	errTooManyStreams = &hop.Error{Status: fasthttp.StatusServiceUnavailable, Type: "server_error", Code: "overloaded",
		Message: "too many requests in flight on this node; retry shortly", RetryAfter: 1}
	errInternal = &hop.Error{Status: fasthttp.StatusInternalServerError, Type: "server_error", Code: "internal_error",
		Message: "internal error; the node logged it and keeps serving"}
	errKVBusy = &hop.Error{Status: fasthttp.StatusServiceUnavailable, Type: "server_error", Code: "overloaded",
		Message: "KV imports busy on this node; the conversation is recomputed", RetryAfter: 1}
	errTooManyFeeds = &hop.Error{Status: fasthttp.StatusServiceUnavailable, Type: "server_error", Code: "overloaded",
		Message: "too many event feeds open on this node", RetryAfter: 5}
	errNotReady = &hop.Error{Status: fasthttp.StatusServiceUnavailable, Type: "server_error", Code: "not_ready",
		Message: "this node is not ready to serve (loading the model or shutting down)", RetryAfter: 2}
)

func methodNotAllowed(allow string) *hop.Error {
	return &hop.Error{Status: fasthttp.StatusMethodNotAllowed, Type: "invalid_request_error", Code: "method_not_allowed",
		Message: "method not allowed; use " + allow}
}

// toAPIError maps any error a request can meet to what the client is told. It is the only
// place that decides statuses for errors.
func toAPIError(err error) *hop.Error {
	var ae *hop.Error
	var invalid *infer.InvalidError
	var tooLong *infer.PromptTooLongError
	var denied *quota.Denied
	switch {
	case errors.As(err, &ae): // ours, or a peer's as it came across the hop
		return ae
	case errors.Is(err, hop.ErrUnauthorized):
		e := *errUnauthorized
		e.Message = err.Error()
		return &e
	case errors.Is(err, hop.ErrVersion):
		e := badRequest("", "%s", err.Error())
		e.Code = "hop_version"
		return e
	case errors.As(err, &tooLong):
		e := badRequest("messages", "%s", tooLong.Error())
		e.Code = "context_length_exceeded"
		return e
	case errors.As(err, &invalid):
		return badRequest(invalid.Param, "%s", invalid.Error())
	case errors.Is(err, infer.ErrInvalid):
		return badRequest("", "%s", err.Error())
	case errors.Is(err, infer.ErrOverloaded):
		retry := 1
		var o *infer.OverloadedError
		if errors.As(err, &o) {
			retry = max(1, int(math.Ceil(o.RetryAfter.Seconds())))
		}
		return &hop.Error{Status: fasthttp.StatusServiceUnavailable, Type: "server_error", Code: "overloaded",
			Message: err.Error(), RetryAfter: retry}
	case errors.Is(err, infer.ErrClosed):
		return errNotReady
	case errors.Is(err, infer.ErrFrame):
		return &hop.Error{Status: fasthttp.StatusBadRequest, Type: "invalid_request_error", Code: "kv_frame", Message: err.Error()}
	case errors.Is(err, infer.ErrNotCached):
		return &hop.Error{Status: fasthttp.StatusNotFound, Type: "invalid_request_error", Code: "not_cached", Message: err.Error()}
	case errors.As(err, &denied):
		kind := denied.Kind
		if kind == "concurrent" {
			kind = "requests"
		}
		return &hop.Error{Status: fasthttp.StatusTooManyRequests, Type: kind, Code: "rate_limit_exceeded", Message: denied.Error(),
			RetryAfter: int(math.Ceil(denied.RetryAfter.Seconds()))}
	case errors.Is(err, context.DeadlineExceeded):
		return &hop.Error{Status: fasthttp.StatusGatewayTimeout, Type: "server_error", Code: "timeout",
			Message: "request deadline exceeded"}
	case errors.Is(err, infer.ErrCanceled):
		// Nobody is listening; 499 (client closed request) is for logs and metrics.
		return &hop.Error{Status: 499, Type: "server_error", Code: "canceled", Message: err.Error()}
	default:
		return &hop.Error{Status: fasthttp.StatusInternalServerError, Type: "server_error", Code: "internal_error",
			Message: err.Error()}
	}
}

// writeError sends err as an OpenAI error response.
func writeError(ctx *fasthttp.RequestCtx, err error) *hop.Error {
	e := toAPIError(err)
	ctx.Response.Reset()
	ctx.SetStatusCode(e.Status)
	ctx.SetContentType("application/json")
	if e.RetryAfter > 0 {
		ctx.Response.Header.Set("Retry-After", strconv.Itoa(e.RetryAfter))
	}
	ctx.SetBody(e.Body())
	return e
}

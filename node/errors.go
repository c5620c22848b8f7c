package node

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"

	"github.com/valyala/fasthttp"

	"github.com/infernode/infernode/node/routing"
	"github.com/infernode/infernode/session/infer"
)

// apiError is an error as an OpenAI-compatible client sees it: a status and
// {"error": {"message", "type", "param", "code"}}.
type apiError struct {
	Status     int    `json:"-"`
	Message    string `json:"message"`
	Type       string `json:"type"`
	Param      any    `json:"param"` // string or null
	Code       any    `json:"code"`  // string or null
	RetryAfter int    `json:"-"`     // seconds; 0 sends no Retry-After
}

func (e *apiError) Error() string { return e.Message }

func badRequest(param, format string, args ...any) *apiError {
	return &apiError{Status: fasthttp.StatusBadRequest, Type: "invalid_request_error", Param: nullable(param),
		Message: fmt.Sprintf(format, args...)}
}

func unsupported(param string) *apiError {
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
	errStandalone = &apiError{Status: fasthttp.StatusNotFound, Type: "invalid_request_error", Code: "not_clustered",
		Message: "this node runs standalone (no --gossip-addr)"}
	errNotFound = &apiError{Status: fasthttp.StatusNotFound, Type: "invalid_request_error", Code: "not_found",
		Message: "no such route"}
	errUnauthorized = &apiError{Status: fasthttp.StatusUnauthorized, Type: "invalid_request_error", Code: "invalid_api_key",
		Message: "missing or wrong API key: send Authorization: Bearer <key>"}
	errBodyTooLarge = &apiError{Status: fasthttp.StatusRequestEntityTooLarge, Type: "invalid_request_error",
		Code: "request_too_large", Message: "request body is larger than this node accepts"}
	errContentType = &apiError{Status: fasthttp.StatusUnsupportedMediaType, Type: "invalid_request_error",
		Code: "unsupported_media_type", Message: "Content-Type must be application/json"}
	errTooManyStreams = &apiError{Status: fasthttp.StatusServiceUnavailable, Type: "server_error", Code: "overloaded",
		Message: "too many requests in flight on this node; retry shortly", RetryAfter: 1}
	errInternal = &apiError{Status: fasthttp.StatusInternalServerError, Type: "server_error", Code: "internal_error",
		Message: "internal error; the node logged it and keeps serving"}
	errNotReady = &apiError{Status: fasthttp.StatusServiceUnavailable, Type: "server_error", Code: "not_ready",
		Message: "this node is not ready to serve (loading the model or shutting down)", RetryAfter: 2}
)

func methodNotAllowed(allow string) *apiError {
	return &apiError{Status: fasthttp.StatusMethodNotAllowed, Type: "invalid_request_error", Code: "method_not_allowed",
		Message: "method not allowed; use " + allow}
}

// toAPIError maps any error a request can meet to what the client is told. It is the only
// place that decides statuses for errors.
func toAPIError(err error) *apiError {
	var ae *apiError
	var invalid *infer.InvalidError
	var tooLong *infer.PromptTooLongError
	var hop *routing.Error
	switch {
	case errors.As(err, &ae):
		return ae
	case errors.As(err, &hop):
		return &apiError{Status: hop.Status, Message: hop.Message, Type: hop.Type, Param: hop.Param, Code: hop.Code,
			RetryAfter: hop.RetryAfter}
	case errors.Is(err, routing.ErrUnauthorized):
		e := *errUnauthorized
		e.Message = err.Error()
		return &e
	case errors.Is(err, routing.ErrVersion):
		e := badRequest("", "%s", err.Error())
		e.Code = "hop_version"
		return e
	case errors.Is(err, routing.ErrNoModel): // its last node left between parsing and routing
		return &apiError{Status: fasthttp.StatusNotFound, Type: "invalid_request_error", Param: "model", Code: "model_not_found",
			Message: err.Error()}
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
		return &apiError{Status: fasthttp.StatusServiceUnavailable, Type: "server_error", Code: "overloaded",
			Message: err.Error(), RetryAfter: retry}
	case errors.Is(err, infer.ErrClosed):
		return errNotReady
	case errors.Is(err, infer.ErrFrame):
		return &apiError{Status: fasthttp.StatusBadRequest, Type: "invalid_request_error", Code: "kv_frame", Message: err.Error()}
	case errors.Is(err, infer.ErrNotCached):
		return &apiError{Status: fasthttp.StatusNotFound, Type: "invalid_request_error", Code: "not_cached", Message: err.Error()}
	case errors.Is(err, context.DeadlineExceeded):
		return &apiError{Status: fasthttp.StatusGatewayTimeout, Type: "server_error", Code: "timeout",
			Message: "request deadline exceeded"}
	case errors.Is(err, infer.ErrCanceled):
		// Nobody is listening; 499 (client closed request) is for logs and metrics.
		return &apiError{Status: 499, Type: "server_error", Code: "canceled", Message: err.Error()}
	default:
		return &apiError{Status: fasthttp.StatusInternalServerError, Type: "server_error", Code: "internal_error",
			Message: err.Error()}
	}
}

// hopError is err as it crosses the hop back to the entry node.
func hopError(err error) *routing.Error {
	e := toAPIError(err)
	return &routing.Error{Status: e.Status, Message: e.Message, Type: e.Type, Param: e.Param, Code: e.Code, RetryAfter: e.RetryAfter}
}

// errorBody is the JSON of an error response or SSE error event.
func errorBody(e *apiError) []byte {
	b, _ := json.Marshal(struct {
		Error *apiError `json:"error"`
	}{e})
	return b
}

// writeError sends err as an OpenAI error response.
func writeError(ctx *fasthttp.RequestCtx, err error) *apiError {
	e := toAPIError(err)
	ctx.Response.Reset()
	ctx.SetStatusCode(e.Status)
	ctx.SetContentType("application/json")
	if e.RetryAfter > 0 {
		ctx.Response.Header.Set("Retry-After", strconv.Itoa(e.RetryAfter))
	}
	ctx.SetBody(errorBody(e))
	return e
}

package node

import (
	"errors"
	"strconv"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/infernode/infernode/node/hop"
	"github.com/infernode/infernode/node/kvmove"
	"github.com/infernode/infernode/session/infer"
)

// The receiving ends of KV movement (see kvmove): frames peers push, and pulls.

// handleKV takes a conversation's KV frame pushed by a peer (POST hop.KVPath or
// hop.ReplicaPath).
//
// The frame is read only once its signature over the hash its headers declare checks out,
// into a buffer kept between imports, and hashed as it arrives; then the hash it has is
// checked against the signature. Hop headers alone prove nothing: anyone can send them.
func (s *Server) handleKV(ctx *fasthttp.RequestCtx, replica bool) {
	auth := s.cluster.Hop()
	in := inboundHeaders(ctx)
	if err := auth.Preverify(in.Method, in.Path, in.Header); err != nil {
		writeError(ctx, err)
		return
	}
	n := ctx.Request.Header.ContentLength()
	if n < 0 || n > s.cfg.MaxKVBytes {
		writeError(ctx, errBodyTooLarge) // a frame's length is always declared
		return
	}
	select {
	case s.kvImports <- struct{}{}:
		defer func() { <-s.kvImports }()
	default:
		writeError(ctx, errKVBusy)
		return
	}
	// A frame may take longer to arrive than ReadTimeout allows a request: as long as it
	// takes at minKVRate, beyond it (as a pull's answer may take to send).
	ctx.SetReadDeadline(time.Now().Add(s.cfg.ReadTimeout + time.Duration(float64(n)/minKVRate*float64(time.Second))))
	buf := s.kvBufs.Get()
	defer s.kvBufs.Put(buf)
	frame := s.kvBufs.Sized(buf, n)
	h := hop.HashFor(in.Header)
	if err := hop.ReadHashing(ctx.RequestBodyStream(), frame, h); err != nil {
		writeError(ctx, badRequest("", "cannot read the KV frame: %v", err))
		return
	}
	if err := auth.AuthenticateSum(in, hop.SumFrom(h)); err != nil {
		writeError(ctx, err)
		return
	}
	origin := infer.Pushed
	switch {
	case replica:
		origin = infer.Replica
	case string(ctx.Request.Header.Peek(hop.HeaderKVWhy)) == hop.KVWhyLeaving:
		origin = infer.HandOff
	}
	res, err := s.cluster.TakeKV(s.base, frame, origin, string(ctx.Request.Header.Peek(hop.HeaderFrom)))
	if err != nil {
		writeError(ctx, err)
		return
	}
	writeJSON(ctx, fasthttp.StatusOK, res)
}

// handlePull answers a peer that joined lately and now owns a conversation with the
// conversation's KV frame (POST hop.PullPath, the key as body), unless it is not held
// here (404) or the peer would recompute it sooner (204). The copy here stays, as a
// replica.
func (s *Server) handlePull(ctx *fasthttp.RequestCtx) {
	if err := s.cluster.Hop().Authenticate(inbound(ctx)); err != nil {
		writeError(ctx, err)
		return
	}
	frame, err := s.cluster.GiveKV(s.base, string(ctx.PostBody()), string(ctx.Request.Header.Peek(hop.HeaderFrom)),
		string(ctx.Request.Header.Peek(hop.HeaderNonce)), hop.MinorOf(string(ctx.Request.Header.Peek(hop.HeaderVersion))), ctx.Response.Header.Set)
	switch {
	case errors.Is(err, kvmove.ErrNotHeld):
		ctx.SetStatusCode(fasthttp.StatusNotFound)
		return
	case errors.Is(err, kvmove.ErrRecompute):
		ctx.SetStatusCode(fasthttp.StatusNoContent)
		return
	case err != nil:
		writeError(ctx, err)
		return
	}
	ctx.SetContentType("application/octet-stream")
	ctx.Response.Header.Set(hop.HeaderFrameBytes, strconv.Itoa(frame.Len()))
	// A frame may take longer to send than WriteTimeout allows an answer: as long as it
	// takes at minKVRate, beyond it. (The puller bounds its wait by the prefill it saves.)
	ctx.SetWriteDeadline(time.Now().Add(s.cfg.WriteTimeout + time.Duration(float64(frame.Len())/minKVRate*float64(time.Second))))
	ctx.SetBodyStream(frameStream{frame}, frame.Len())
}

// minKVRate is the slowest link a KV frame is sent over before the sender gives up, in
// bytes a second (10 Mbit/s).
const minKVRate = 10e6 / 8

// frameStream is a pull's answer: fasthttp writes a body stream that is an io.WriterTo
// with its WriteTo, straight from the frame's memory to the connection, and closes it
// after. (A stream writer went through a pipe and chunks of 4 KB: 40-50 MB/s.)
type frameStream struct{ infer.Frame }

func (frameStream) Read([]byte) (int, error) { return 0, errFrameStream }

// Close releases the frame once it is written, or was not.
func (s frameStream) Close() error { s.Release(); return nil }

var errFrameStream = errors.New("a KV frame is written with WriteTo, not read")

// handleQuota serves a peer's lease of a rate-limit bucket kept here (see
// quota.Quota.Serve).
func (s *Server) handleQuota(ctx *fasthttp.RequestCtx) {
	in := inbound(ctx)
	if err := s.cluster.Hop().Authenticate(in); err != nil {
		writeError(ctx, err)
		return
	}
	status, body := s.cluster.Quota().Serve(in, ctx.Response.Header.Set)
	ctx.SetStatusCode(status)
	if body != nil {
		ctx.SetContentType("application/json")
		ctx.SetBody(body)
	}
}

// handleStored serves a peer's stored-response hop (see stored.Keeper.Serve).
func (s *Server) handleStored(ctx *fasthttp.RequestCtx) {
	in := inbound(ctx)
	if err := s.cluster.Hop().Authenticate(in); err != nil {
		writeError(ctx, err)
		return
	}
	status, body := s.cluster.Stored().Serve(s.base, in, ctx.Response.Header.Set)
	ctx.SetStatusCode(status)
	if body != nil {
		ctx.SetContentType("application/json")
		ctx.SetBody(body)
	}
}

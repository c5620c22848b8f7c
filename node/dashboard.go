package node

import (
	_ "embed"
	"time"

	"github.com/valyala/fasthttp"
)

// dashboard is the page served at GET /: members, the ring, and the event feed of the
// node it is loaded from, drawn in the browser from GET /v1/cluster and GET /v1/events.
// It is one self-contained file: no CDN, no build step.
//
//go:embed dashboard.html
var dashboard []byte

// maxRingPoints bounds GET /v1/cluster?ring=N.
const maxRingPoints = 3600

func (s *Server) handleDashboard(ctx *fasthttp.RequestCtx) {
	ctx.SetContentType("text/html; charset=utf-8")
	ctx.Response.Header.Set("Cache-Control", "no-cache")
	ctx.Response.Header.Set("Content-Security-Policy", "default-src 'self'; style-src 'unsafe-inline'; script-src 'unsafe-inline'")
	ctx.SetBody(dashboard)
}

// feedKeepAlive is how often an idle event feed sends a comment, so proxies and the
// browser keep it open.
const feedKeepAlive = 15 * time.Second

// handleEvents serves GET /v1/events: server-sent events, one JSON routing.Happening
// each, the recent ones first, then as they happen, until the client goes or the node
// shuts down.
func (s *Server) handleEvents(ctx *fasthttp.RequestCtx) {
	if s.feeds.Add(1) > int64(s.cfg.MaxFeeds) {
		s.feeds.Add(-1)
		writeError(ctx, errTooManyFeeds)
		return
	}
	recent, next, stop := s.cluster.Happenings()
	done := func() { stop(); s.feeds.Add(-1) }
	s.streamBody(ctx, "text/event-stream", true, func(error) {}, done, func(sse *sseWriter) error {
		for _, e := range recent {
			if err := sse.event(e); err != nil {
				return err
			}
		}
		if err := sse.comment("live"); err != nil {
			return err
		}
		tick := time.NewTicker(feedKeepAlive)
		defer tick.Stop()
		for {
			var err error
			select {
			case e := <-next:
				err = sse.event(e)
			case <-tick.C:
				err = sse.comment("keep-alive")
			case <-s.stopFeeds:
				return nil
			case <-s.base.Done():
				return nil
			}
			if err != nil {
				return err
			}
		}
	})
}

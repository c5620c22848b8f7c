package node

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/valyala/fasthttp"
	"github.com/valyala/fasthttp/fasthttpadaptor"

	"github.com/infernode/infernode/internal/keep"
	"github.com/infernode/infernode/node/hop"
	"github.com/infernode/infernode/node/quota"
	"github.com/infernode/infernode/node/routing"
	"github.com/infernode/infernode/session/infer"
)

// Engine is what a node needs of the inference engine: *session.Handle in a real node,
// fakes in tests. Implementations must be safe for concurrent use.
type Engine interface {
	// Submit starts a generation; see session.Engine.Submit.
	Submit(ctx context.Context, req infer.Request) (infer.Stream, error)
	// ChatPrompt formats a conversation with the model's chat template.
	ChatPrompt(msgs []infer.Message) (string, error)
	// Tokenize and Detokenize turn text into the model's tokens and back; SeqCells is the
	// most tokens one conversation holds.
	Tokenize(text string, addSpecial bool) ([]int32, error)
	Detokenize(tokens []int32) (string, error)
	SeqCells() int
	Stats() infer.Stats
	Ready() bool
}

// Server serves the HTTP API of one node.
type Server struct {
	cfg       Config
	log       *slog.Logger
	engine    Engine  // the local engine
	cluster   Cluster // its routing.Router, or Standalone
	metrics   *metrics
	http      *fasthttp.Server
	promh     fasthttp.RequestHandler
	routes    map[string]route
	slots     chan struct{}           // one token per in-flight generation (MaxStreams)
	kvImports chan struct{}           // one token per KV frame being installed (KVImports)
	kvBufs    *keep.Buffers           // the frames being installed are read into, kept between imports
	feeds     atomic.Int64            // event feeds open
	keys      atomic.Pointer[keyring] // the key file's (see tenants.go)
	ids       idMinter                // stored responses' ids (see ids.go)
	alerts    *alerts                 // latency anomalies (see alerts.go)
	created   int64
	// stopFeeds is closed when the server shuts down: event feeds (GET /v1/events) end.
	stopFeeds chan struct{}

	// base is the parent of every request's context; canceling it ends them all.
	base       context.Context
	cancelBase context.CancelFunc

	mu       sync.Mutex
	active   int           // generations in flight; guarded by mu
	draining bool          // no new generations; guarded by mu
	drained  chan struct{} // closed when active drops to 0 while draining; guarded by mu

	closeOnce sync.Once
}

// submitFunc starts a generation somewhere: on the local engine, or on its owner.
type submitFunc func(ctx context.Context, req infer.Request) (infer.Stream, error)

// New builds a server in front of engine, in cluster (Standalone(engine, ...) for a node
// without peers): client requests go to their conversation's owner, and requests
// forwarded by peers are served by engine. It starts nothing: Run serves (and the caller
// runs the cluster).
func New(cfg Config, engine Engine, cluster Cluster) (*Server, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("node config: %w", err)
	}
	if engine == nil || cluster == nil {
		return nil, errors.New("node: engine and cluster are required")
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	s := &Server{
		cfg:       cfg,
		log:       log.With("component", "node", "node", cfg.ID),
		engine:    engine,
		cluster:   cluster,
		metrics:   newMetrics(engine.Stats),
		slots:     make(chan struct{}, cfg.MaxStreams),
		created:   time.Now().Unix(),
		stopFeeds: make(chan struct{}),
		ids:       newIDMinter(cfg.IDKey),
	}
	keys := keyring{}
	if cfg.KeyFile != "" {
		var err error
		if keys, err = loadKeys(cfg.KeyFile); err != nil {
			return nil, err
		}
	}
	s.keys.Store(&keys)
	if cfg.LimitsFile != "" {
		limits, err := quota.Load(cfg.LimitsFile)
		if err != nil {
			return nil, err
		}
		cluster.Quota().SetLimits(limits)
	}
	s.metrics.reg.MustRegister(cluster.Collectors()...)
	s.alerts = newAlerts(cfg.Anomaly, s.metrics.reg)
	s.base, s.cancelBase = context.WithCancel(context.Background())
	s.promh = fasthttpadaptor.NewFastHTTPHandler(promhttp.HandlerFor(s.metrics.reg, promhttp.HandlerOpts{}))
	s.routes = s.routeTable()
	s.kvImports = make(chan struct{}, cfg.KVImports)
	s.kvBufs = keep.New(cfg.KVImports, cfg.MaxKVBytes)
	s.http = &fasthttp.Server{
		Handler:      s.handle,
		ErrorHandler: s.handleParseError,
		Name:         "infernode",
		Concurrency:  cfg.MaxConns,
		// Bodies come to the handler as streams: a KV frame is hashed as it arrives
		// (handleKV), and every other body is read by handle, within MaxBodyBytes. No
		// route takes a form: fasthttp would read a multipart one whole first, into
		// files past 16 MiB, whatever its length.
		StreamRequestBody:            true,
		DisablePreParseMultipartForm: true,
		ReadTimeout:                  cfg.ReadTimeout,
		WriteTimeout:                 cfg.WriteTimeout, // per response; streams extend it per event
		IdleTimeout:                  cfg.IdleTimeout,
		CloseOnShutdown:              true,
		NoDefaultContentType:         true,
		Logger:                       fasthttpLogger{s.log},
	}
	return s, nil
}

// Run serves until ctx ends, then drains: it stops accepting, lets requests in flight
// finish for up to DrainTimeout, cancels the rest (their clients get an explicit error)
// and returns.
func (s *Server) Run(ctx context.Context) error {
	ln := s.cfg.Listener
	if ln == nil {
		var err error
		if ln, err = net.Listen("tcp", s.cfg.Addr); err != nil {
			return fmt.Errorf("listen %s: %w", s.cfg.Addr, err)
		}
	}
	if s.cfg.MaxConnsPerIP > 0 {
		ln = capPerIP(ln, s.cfg.MaxConnsPerIP, s.cluster.Peer, s.metrics.capped.Inc)
	}
	s.log.Info("serving", "addr", ln.Addr().String(), "model", s.cfg.ModelName)
	errc := make(chan error, 1)
	go func() { errc <- s.http.Serve(ln) }()
	select {
	case err := <-errc:
		return fmt.Errorf("serve: %w", err)
	case <-ctx.Done():
	}
	// Keep accepting while draining: /readyz says 503, and what still arrives (a client
	// that has not noticed, a request already on a kept-alive connection) is handed to
	// the next owner rather than refused or cut.
	// The caches move to their next owners meanwhile, and the API keeps answering their
	// pulls until they have (see Cluster.Leave), for up to the drain timeout again.
	s.log.Info("draining", "timeout", s.cfg.DrainTimeout)
	drained := s.drain()
	hctx, cancel := context.WithTimeout(context.Background(), 2*s.cfg.DrainTimeout)
	defer cancel()
	early := make(chan struct{})
	go func() {
		defer close(early)
		s.cluster.Leave(hctx, false)
	}()
	select {
	case <-drained:
	case <-time.After(s.cfg.DrainTimeout):
		s.log.Warn("drain timeout: canceling requests in flight")
		s.cancelBase()
		<-drained
	}
	<-early
	s.cluster.Leave(hctx, true)
	close(s.stopFeeds)       // event feeds end, so shutdown need not wait for them
	err := s.http.Shutdown() // stops accepting, closes idle connections, waits for the rest
	s.Close()
	if err != nil {
		return fmt.Errorf("shutdown: %w", err)
	}
	s.log.Info("stopped")
	return nil
}

// begin counts a generation in flight (end must follow) and reports whether the server
// is draining.
func (s *Server) begin() (draining bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.active++
	return s.draining
}

func (s *Server) isDraining() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.draining
}

func (s *Server) end() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.active--
	if s.active == 0 && s.drained != nil {
		close(s.drained)
		s.drained = nil
	}
}

// drain refuses new generations and returns a channel closed once none is in flight.
func (s *Server) drain() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.draining = true
	ch := make(chan struct{})
	if s.active == 0 {
		close(ch)
	} else {
		s.drained = ch
	}
	return ch
}

// Close cancels every request in flight. It is safe to call twice.
func (s *Server) Close() {
	s.closeOnce.Do(s.cancelBase)
}

// handle routes a request. Every request is counted under a label from a fixed set (a
// route, or "other"), never its raw path: a path is client input, possibly not even UTF-8,
// and each distinct label would be a metric series of its own. A panic in a handler is
// recovered, logged with its stack, counted and answered 500: the node stays up.
func (s *Server) handle(ctx *fasthttp.RequestCtx) {
	path := string(ctx.Path())
	endpoint := "other"
	defer func() {
		if v := recover(); v != nil {
			s.log.Error("handler panic", "endpoint", endpoint, "panic", v, "stack", string(debug.Stack()))
			s.metrics.panics.Inc()
			ctx.Response.Reset()
			writeError(ctx, errInternal)
		}
		if len(ctx.Response.Header.Peek(hop.NodeHeader)) == 0 {
			ctx.Response.Header.Set(hop.NodeHeader, s.cfg.ID)
		}
		s.metrics.request(endpoint, ctx.Response.StatusCode())
	}()
	r, ok := s.routes[path]
	if ok {
		endpoint = path
	} else if id, found := strings.CutPrefix(path, "/v1/models/"); found && id != "" {
		endpoint = "/v1/models/{id}"
		r, ok = route{method: fasthttp.MethodGet, auth: client, serve: func(ctx *fasthttp.RequestCtx) { s.handleModel(ctx, id) }}, true
	} else if id, found := strings.CutPrefix(path, "/v1/responses/"); found && id != "" && !strings.Contains(id, "/") {
		endpoint = "/v1/responses/{id}"
		method := fasthttp.MethodGet
		if string(ctx.Method()) == fasthttp.MethodDelete {
			method = fasthttp.MethodDelete
		}
		r, ok = route{method: method, auth: client, serve: func(ctx *fasthttp.RequestCtx) { s.handleResponse(ctx, id) }}, true
	}
	if !r.kv {
		// Every route but a KV frame's keeps the API's bound, whether it exists or not.
		if err := s.readBody(ctx); err != nil {
			writeError(ctx, err)
			return
		}
	}
	switch {
	case !ok:
		writeError(ctx, errNotFound)
	default:
		s.guard(ctx, r)
	}
}

// readBody reads a request's body, streamed by the server, into the request: at most
// MaxBodyBytes. One declared longer than that and bodySlack is refused before any of it is
// read; one up to bodySlack over is refused once past the bound, and the server drops
// the rest, so that a client slightly over gets a clean 413 rather than a reset.
func (s *Server) readBody(ctx *fasthttp.RequestCtx) error {
	if !ctx.Request.IsBodyStream() {
		return nil
	}
	if ctx.Request.Header.ContentLength() > s.cfg.MaxBodyBytes+bodySlack {
		return errBodyTooLarge
	}
	body, err := io.ReadAll(io.LimitReader(ctx.RequestBodyStream(), int64(s.cfg.MaxBodyBytes)+1))
	switch {
	case err != nil:
		return badRequest("", "cannot read the request body: %v", err)
	case len(body) > s.cfg.MaxBodyBytes:
		return errBodyTooLarge
	}
	ctx.Request.SetBodyRaw(body)
	return nil
}

// bodySlack is how far over MaxBodyBytes a body is read before it is refused; fasthttp
// reads and drops up to 256 KiB a handler left unread, and closes the connection past it.
const bodySlack = 64 << 10

// route is how one path is served.
type route struct {
	method string
	auth   access
	kv     bool // the body is a KV frame, bounded by MaxKVBytes rather than MaxBodyBytes
	serve  fasthttp.RequestHandler
}

// access is who may use a route.
type access int

const (
	open     access = iota // anyone: probes, the dashboard's page, the hop (signed instead)
	client                 // a tenant's API key (see tenants.go)
	operator               // the operator's key
)

// routes are the paths a node serves, and so the only endpoint labels besides
// "/v1/models/{id}", "/v1/responses/{id}" and "other". A node that takes no hops (standalone) has no hop
// endpoints, and says so on the cluster's.
func (s *Server) routeTable() map[string]route {
	get, post := fasthttp.MethodGet, fasthttp.MethodPost
	metrics := operator
	if s.cfg.MetricsOpen {
		metrics = open
	}
	routes := map[string]route{
		"/v1/chat/completions": {method: post, auth: client, serve: func(ctx *fasthttp.RequestCtx) { s.handleCompletion(ctx, true) }},
		"/v1/completions":      {method: post, auth: client, serve: func(ctx *fasthttp.RequestCtx) { s.handleCompletion(ctx, false) }},
		"/v1/responses":        {method: post, auth: client, serve: s.handleResponses},
		"/v1/models":           {method: get, auth: client, serve: s.handleModels},
		"/tokenize":            {method: post, auth: client, serve: s.handleTokenize},
		"/detokenize":          {method: post, auth: client, serve: s.handleDetokenize},
		"/healthz": {method: get, serve: func(ctx *fasthttp.RequestCtx) {
			writeJSON(ctx, fasthttp.StatusOK, map[string]string{"status": "ok"})
		}},
		"/readyz": {method: get, serve: s.handleReady},
		// The page holds no data (it fetches it with the key the user gives it), so it is
		// served without one.
		"/":          {method: get, serve: s.handleDashboard},
		"/dashboard": {method: get, serve: s.handleDashboard},
		"/metrics":   {method: get, auth: metrics, serve: s.promh},
	}
	if s.cluster.Hop() == nil {
		standalone := func(ctx *fasthttp.RequestCtx) { writeError(ctx, errStandalone) }
		routes["/v1/cluster"] = route{method: get, auth: operator, serve: standalone}
		routes["/v1/events"] = route{method: get, auth: operator, serve: standalone}
		return routes
	}
	routes["/v1/cluster"] = route{method: get, auth: operator, serve: s.handleCluster}
	routes["/v1/events"] = route{method: get, auth: operator, serve: s.handleEvents}
	routes[hop.Path] = route{method: post, serve: s.handleInternal}
	routes[hop.KVPath] = route{method: post, kv: true, serve: func(ctx *fasthttp.RequestCtx) { s.handleKV(ctx, false) }}
	routes[hop.ReplicaPath] = route{method: post, kv: true, serve: func(ctx *fasthttp.RequestCtx) { s.handleKV(ctx, true) }}
	routes[hop.PullPath] = route{method: post, serve: s.handlePull}
	routes[hop.StoredPath] = route{method: post, serve: s.handleStored}
	routes[hop.QuotaPath] = route{method: post, serve: s.handleQuota}
	return routes
}

// guard checks method and API key, then serves.
func (s *Server) guard(ctx *fasthttp.RequestCtx, r route) {
	switch {
	case string(ctx.Method()) != r.method:
		ctx.Response.Header.Set("Allow", r.method)
		writeError(ctx, methodNotAllowed(r.method))
	case r.auth == client && !s.isClient(ctx), r.auth == operator && !s.operator(ctx):
		writeError(ctx, errUnauthorized)
	default:
		r.serve(ctx)
	}
}

func (s *Server) isClient(ctx *fasthttp.RequestCtx) bool {
	_, ok := s.client(ctx)
	return ok
}

// handleParseError answers requests fasthttp could not read (malformed headers; a body
// is read by the handlers, see readBody).
func (s *Server) handleParseError(ctx *fasthttp.RequestCtx, err error) {
	e := writeError(ctx, badRequest("", "cannot read the HTTP request: %v", err))
	ctx.SetConnectionClose()
	s.metrics.request("unreadable", e.Status)
}

// ready reports whether this node serves: model loaded and warmed, and (in a cluster)
// gossip joined. It does not depend on being on anyone's ring: peers probe it to decide that.
func (s *Server) ready() (bool, string) { return s.cluster.Ready() }

func (s *Server) handleReady(ctx *fasthttp.RequestCtx) {
	ok, why := s.ready()
	if ok && s.isDraining() {
		ok, why = false, "draining: finishing the requests in flight before exiting"
	}
	if !ok {
		ctx.Response.Header.Set("Retry-After", "2")
		writeJSON(ctx, fasthttp.StatusServiceUnavailable, map[string]any{"ready": false, "reason": why})
		return
	}
	writeJSON(ctx, fasthttp.StatusOK, map[string]any{"ready": true})
}

func (s *Server) handleCluster(ctx *fasthttp.RequestCtx) {
	points := 0
	if arg := ctx.QueryArgs().Peek("ring"); arg != nil {
		n, err := strconv.Atoi(string(arg))
		if err != nil || n < 0 || n > maxRingPoints {
			writeError(ctx, badRequest("ring", "ring must be a number of points in [0, %d]", maxRingPoints))
			return
		}
		points = n
	}
	// The cluster as routing sees it, and this node's latency lately (the last 10 s
	// bucket's means, in seconds), for the dashboard's charts.
	writeJSON(ctx, fasthttp.StatusOK, struct {
		routing.View
		Latency map[string]float64 `json:"latency"`
	}{s.cluster.View(points), map[string]float64{seriesTTFT: s.alerts.d.Last(seriesTTFT), seriesITL: s.alerts.d.Last(seriesITL)}})
}

type modelObject struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	OwnedBy string `json:"owned_by"`
	// Nodes is how many live nodes of the cluster serve the model, and Ready how many of
	// them are on its ring here (ready and healthy). infernode's own fields.
	Nodes int  `json:"nodes"`
	Ready int  `json:"ready_nodes"`
	Local bool `json:"local"` // served by this node
}

// models lists the models the cluster serves, this node's first.
func (s *Server) models() []modelObject {
	var out []modelObject
	for _, m := range s.cluster.Models() {
		out = append(out, modelObject{ID: m.ID, Object: "model", Created: s.created, OwnedBy: "infernode",
			Nodes: m.Nodes, Ready: m.Ready, Local: m.Local})
	}
	return out
}

func (s *Server) handleModels(ctx *fasthttp.RequestCtx) {
	writeJSON(ctx, fasthttp.StatusOK, map[string]any{"object": "list", "data": s.models()})
}

func (s *Server) handleModel(ctx *fasthttp.RequestCtx, id string) {
	for _, m := range s.models() {
		if m.ID == id {
			writeJSON(ctx, fasthttp.StatusOK, m)
			return
		}
	}
	writeError(ctx, s.unknownModel(id))
}

// unknownModel is the answer to a request for a model no node serves: it names those
// that exist.
func (s *Server) unknownModel(id string) *hop.Error {
	var ids []string
	for _, m := range s.models() {
		ids = append(ids, strconv.Quote(m.ID))
	}
	return &hop.Error{Status: fasthttp.StatusNotFound, Type: "invalid_request_error", Param: "model", Code: "model_not_found",
		Message: fmt.Sprintf("model %q is not served by this cluster; the models are %s", id, strings.Join(ids, ", "))}
}

func writeJSON(ctx *fasthttp.RequestCtx, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		writeError(ctx, err)
		return
	}
	ctx.SetStatusCode(status)
	ctx.SetContentType("application/json")
	ctx.SetBody(b)
}

// fasthttpLogger sends fasthttp's own messages to slog.
type fasthttpLogger struct{ log *slog.Logger }

func (l fasthttpLogger) Printf(format string, args ...any) {
	l.log.Debug("fasthttp", "msg", fmt.Sprintf(format, args...))
}

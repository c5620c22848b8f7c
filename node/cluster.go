package node

import (
	"context"
	"errors"
	"net/netip"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/infernode/infernode/node/answers"
	"github.com/infernode/infernode/node/hop"
	"github.com/infernode/infernode/node/quota"
	"github.com/infernode/infernode/node/routing"
	"github.com/infernode/infernode/node/stored"
	"github.com/infernode/infernode/session/infer"
)

// Cluster is what a node needs of the cluster it belongs to: *routing.Router in a
// cluster, Standalone alone. Implementations are safe for concurrent use.
type Cluster interface {
	// Submit serves a client's request for this node's model on its conversation's owner;
	// SubmitModel one for a model only peers serve; Handoff one on an owner other than
	// this (draining) node; ServeLocal a peer's forwarded request here.
	Submit(ctx context.Context, req infer.Request) (infer.Stream, error)
	SubmitModel(ctx context.Context, model string, req infer.Request) (infer.Stream, error)
	Handoff(ctx context.Context, req infer.Request) (infer.Stream, error)
	ServeLocal(ctx context.Context, req infer.Request) (infer.Stream, error)
	// Place reports whether this node declines a forwarded request that lets it decline
	// above a load, and the node to serve it instead (see routing.Router.Place).
	Place(req infer.Request, above int) (to string, decline bool)
	// Route says where st, a stream Submit returned, is served: the node ("" when it is
	// this node's engine's own), the forwards behind it, and how many times it resumed on
	// another owner mid-answer.
	Route(st infer.Stream) (node string, hops, resumes int)
	// Served is told that a turn of key's conversation, served here, is complete.
	Served(key string, draining bool)
	// Leave hands a leaving node's caches to their next owners, until ctx ends: as the
	// drain begins (drained false) those idle then, the others being passed on by Served as
	// their turns end; once it is over (drained true) whatever has not moved yet.
	Leave(ctx context.Context, drained bool)
	// TakeKV installs a conversation's KV frame a peer pushed; GiveKV answers a peer's
	// pull (its hop's nonce and minor version) with one, to be released after writing,
	// the answer's signature set with sign.
	TakeKV(ctx context.Context, frame []byte, origin infer.Origin, from string) (infer.Imported, error)
	GiveKV(ctx context.Context, key, peer, nonce string, minor int, sign func(name, value string)) (infer.Frame, error)
	// Stored keeps the Responses API's stored responses with their conversations.
	Stored() *stored.Keeper
	// Quota holds tenants to their rate limits, cluster-wide.
	Quota() *quota.Quota
	// Hop verifies what peers send; nil for a node that takes no hops.
	Hop() *hop.Auth
	// Peer reports whether ip is a cluster member's address (exempt from per-client
	// connection caps).
	Peer(ip netip.Addr) bool
	// KeepAlive is how often a forwarded request's answer says the owner is working.
	KeepAlive() time.Duration
	// Ready reports whether this node serves, and why not.
	Ready() (bool, string)
	// Models lists the models the cluster serves, this node's first; Serves reports
	// whether a live peer serves model.
	Models() []routing.ModelInfo
	Serves(model string) bool
	// View is the cluster as this node sees it; Happenings its recent events, then new
	// ones until stop; Happened records one of this node's (an alert).
	View(points int) routing.View
	Happenings() (recent []routing.Happening, next <-chan routing.Happening, stop func())
	Happened(kind, detail string)
	Collectors() []prometheus.Collector
}

// Standalone is a node without peers: everything is served here (groupcache's NoPeers),
// with stored responses and answers kept as stored.DefaultConfig and
// answers.DefaultConfig say.
func Standalone(engine Engine, model string) Cluster {
	c, _ := StandaloneWith(engine, model, stored.DefaultConfig(), answers.DefaultConfig())
	return c
}

// StandaloneWith is Standalone with stored responses kept as st says, answers as ans.
func StandaloneWith(engine Engine, model string, st stored.Config, ans answers.Config) (Cluster, error) {
	k, err := stored.New(st, nil, nil, nil, time.Now)
	err = errors.Join(err, ans.Validate())
	return standalone{engine, model, k, quota.New(nil, nil, nil, nil, time.Now, nil), answers.New(ans, model, time.Now)}, err
}

type standalone struct {
	engine  Engine
	model   string
	stored  *stored.Keeper
	quota   *quota.Quota
	answers *answers.Cache
}

func (s standalone) Submit(ctx context.Context, req infer.Request) (infer.Stream, error) {
	return s.ServeLocal(ctx, req)
}

// SubmitModel is never called for a standalone node (no peer serves another model).
func (s standalone) SubmitModel(ctx context.Context, model string, req infer.Request) (infer.Stream, error) {
	return nil, routing.NoModel(model)
}

// Handoff has no other owner to go to: a draining standalone node is not ready.
func (standalone) Handoff(context.Context, infer.Request) (infer.Stream, error) {
	return nil, infer.ErrClosed
}

func (s standalone) ServeLocal(ctx context.Context, req infer.Request) (infer.Stream, error) {
	return s.answers.Serve(req, func() (infer.Stream, error) { return s.engine.Submit(ctx, req) })
}

func (standalone) Place(infer.Request, int) (string, bool) { return "", false }
func (standalone) Route(infer.Stream) (string, int, int)   { return "", 0, 0 }
func (standalone) Served(string, bool)                     {}
func (standalone) Leave(context.Context, bool)             {}
func (standalone) TakeKV(context.Context, []byte, infer.Origin, string) (infer.Imported, error) {
	return infer.Imported{}, errStandalone
}
func (standalone) GiveKV(context.Context, string, string, string, int, func(string, string)) (infer.Frame, error) {
	return nil, errStandalone
}
func (s standalone) Stored() *stored.Keeper { return s.stored }
func (s standalone) Quota() *quota.Quota    { return s.quota }
func (standalone) Hop() *hop.Auth           { return nil }
func (standalone) Peer(netip.Addr) bool     { return false }
func (standalone) KeepAlive() time.Duration { return 0 }

func (s standalone) Ready() (bool, string) {
	if !s.engine.Ready() {
		return false, "model loading or engine stopped"
	}
	return true, ""
}

func (s standalone) Models() []routing.ModelInfo {
	ready := 0
	if ok, _ := s.Ready(); ok {
		ready = 1
	}
	return []routing.ModelInfo{{ID: s.model, Nodes: 1, Ready: ready, Local: true}}
}

func (standalone) Serves(string) bool    { return false }
func (standalone) View(int) routing.View { return routing.View{} }
func (s standalone) Collectors() []prometheus.Collector {
	return append(append(s.stored.Collectors(), s.quota.Collectors()...), s.answers.Collectors()...)
}
func (standalone) Happened(string, string) {}
func (standalone) Happenings() ([]routing.Happening, <-chan routing.Happening, func()) {
	return nil, nil, func() {}
}

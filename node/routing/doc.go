// Package routing is everything about peers on a request's path: which node owns a
// conversation (a ring for each model, over the peers that serve it and are alive in
// gossip, ready, compatible and healthy by this node's own checks: the view, view.go),
// forwarding a request there over the hop, spilling over to the next owner when one is
// busy, failing over when one is unreachable, and resuming a stream on the next owner when
// its owner dies mid-answer (forward.go).
//
// Busy is not dead: only transport failures (refused, reset, no answer in time) count
// against a peer's health; an answer of 503 (overloaded, not ready) sends the request to the
// next owner and leaves the peer's health alone.
//
// Its parts live in packages of their own: the hop's wire format and signing in hop, the
// movement of conversations' KV in kvmove (the Router builds its Mover and serves its Ring),
// the detection of gray failures in gray (fed by the view's probes and forwards, speed.go).
//
// routing depends on small interfaces (Membership as gossip provides it, Engine as session
// provides it), an http.RoundTripper and a Clock, all injected, so its logic is tested in
// milliseconds with fakes. It knows nothing of the OpenAI API (node's) or of llama.cpp
// (session's), and it builds no HTTP server: node mounts the receiving ends.
package routing

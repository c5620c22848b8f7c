// Package routing is everything about peers on a request's path: which node owns a
// conversation (a ring for each model, over the peers that serve it and are alive in
// gossip, ready, compatible and healthy by this node's own checks), forwarding a request
// there over the hop, spilling over to the next owner when one is busy, failing over when
// one is unreachable, resuming a stream on the next owner when its owner dies mid-answer,
// finding peers that answer but slowly (gray failures: speed.go, with the gray package), and both ends of the hop
// protocol: its versioned wire types, signing and verification.
//
// Busy is not dead: only transport failures (refused, reset, no answer in time) count
// against a peer's health; an answer of 503 (overloaded, not ready) sends the request to the
// next owner and leaves the peer's health alone.
//
// routing depends on small interfaces (Membership as gossip provides it, Engine as session
// provides it), an http.RoundTripper and a Clock, all injected, so its logic is tested in
// milliseconds with fakes. It knows nothing of the OpenAI API (node's) or of llama.cpp
// (session's), and it builds no HTTP server: node serves the hop's endpoint and calls
// Accept and an Answer (and Authenticate for KV frames).
package routing

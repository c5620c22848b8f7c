// Package node is one infernode process's face to the world: an OpenAI-compatible HTTP API
// over fasthttp in front of the session engine, with request limits, conversation keys,
// streaming that cannot hurt the engine, Prometheus metrics, health probes and graceful
// drain.
//
// node composes the other packages and is the only one that knows about HTTP. It does no
// inference itself (that is session's), and it reads no flags or environment (that is
// cmd/infernode's).
package node

// Package node is one infernode process's face to the world: an OpenAI-compatible HTTP API
// over fasthttp with request limits and validation, conversation keys namespaced by
// principal, streaming that cannot hurt the engine, Prometheus metrics, health probes,
// graceful drain, and the HTTP end of the hop between nodes.
//
// node composes the other packages. It does no inference (session's), routes nothing
// itself (a clustered node hands client requests to node/routing, and serves the hop by
// calling routing.Accept and routing.Answer), and reads no flags or environment
// (cmd/infernode's). It depends on the engine only through its plain types (session/infer),
// so it builds and tests without cgo.
package node

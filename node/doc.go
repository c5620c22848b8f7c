// Package node is one infernode process's face to the world: an OpenAI-compatible HTTP API
// over fasthttp with request limits and validation, conversation keys namespaced by
// principal, streaming that cannot hurt the engine, Prometheus metrics, health probes,
// graceful drain, and the HTTP end of the hop between nodes (the receiving end, verified
// with hop.Auth, answered with hop.Answer).
//
// node composes the other packages. It does no inference (session's) and routes nothing
// itself: it hands requests to a Cluster, an interface it declares, which node/routing's
// Router implements in a cluster and Standalone implements alone. It reads no flags or
// environment (cmd/infernode's). It depends on the engine only through its plain types
// (session/infer), so it builds, and its fake-engine tests run, without cgo; node_test.go
// holds the tests with the real engine (cgo).
package node

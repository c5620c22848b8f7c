// Package hop is the protocol between infernode nodes, both ends of it: the versioned wire
// types (a forwarded generation, its answer as JSON lines, KV frames pushed and pulled),
// signing and verification with the cluster secret, the owner's end of an answer (Answer)
// and the reading of a peer's error. Its Error is also the error body every client sees:
// one type for the API and the hop.
//
// hop knows nothing of rings or peers (routing's) or of HTTP servers: node mounts the
// receiving end, routing sends.
package hop

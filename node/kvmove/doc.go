// Package kvmove moves conversations' KV caches between nodes, so that a conversation's
// KV follows its ownership: pushes to a new owner (a join moved the conversation, or this
// node is leaving), replicas to the nodes that would take a conversation over if its owner
// failed, pulls on a miss by a node that joined lately, the receiving ends of all three,
// and the decision between transferring a cache and letting its new owner recompute it
// (bytes over measured bandwidth against tokens over the gossiped prefill rate).
//
// kvmove knows the cluster only through Ring (routing's view implements it) and the
// engine only through Local (session.Handle implements it). Frames travel over the hop
// (node/hop), signed; node mounts the receiving ends.
package kvmove

// Package gossip is a node's membership: SWIM gossip through hashicorp/memberlist. It
// joins (and keeps re-joining) seed peers, carries each node's small metadata (id, HTTP
// address, model fingerprint, readiness, load), and keeps a snapshot of every member and
// its state that the node reads whenever Changes signals.
//
// gossip knows nothing about models, rings or HTTP handlers.
package gossip

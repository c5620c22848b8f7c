// Package gossip is a node's membership: SWIM gossip through hashicorp/memberlist. It
// joins (and keeps re-joining) seed peers, carries each node's tags (a few hundred bytes
// the application encodes, with its protocol versions beside them, as serf does), and keeps
// a snapshot of every member and its state that the node reads whenever Changes signals.
//
// gossip knows nothing about models, rings or HTTP handlers: the tags are opaque to it, and
// a Schema the application gives it (routing's Meta) says the little it must know of them:
// whether they are valid, whether they say their node is leaving, and which changes are
// urgent.
package gossip

// Package ring decides which peer owns a key: a consistent-hash ring with bounded loads
// (github.com/buraksezer/consistent's algorithm and placement, keys hashed with xxhash, 150
// virtual nodes a peer) over the peers that are eligible, and the health hysteresis that
// decides eligibility.
//
// ring does no I/O, starts no goroutines and reads no clock: callers feed it membership
// facts and probe outcomes, and it answers deterministically. A Ring is immutable; a
// Table is safe for concurrent use.
package ring

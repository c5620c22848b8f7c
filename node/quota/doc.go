// Package quota holds tenants to their rate limits across a cluster without a coordinator.
//
// A tenant's limits on a model (requests and tokens a minute, with a burst) are token
// buckets, and each bucket lives on one node: the owner of the bucket's key on the model's
// ring, as a conversation does. Other nodes do not ask it for every request: they lease a
// few seconds' worth of the bucket's capacity in one hop and admit from the lease locally,
// asking again when it runs out (Google's Doorman and CockroachDB's tenant cost control
// lease capacity the same way). Whatever the nodes a client spreads its requests over, all
// of them draw on the one bucket, so the cluster admits the tenant's rate, not N times it.
//
// Why this and not gossip of consumption: gossip converges in seconds, and over those
// seconds every node admits the whole rate on its own (N times the limit); a lease is
// exact to its size. Why leases and not a hop per request: the owner is then on every
// request's path; a lease costs one hop per lease, and a node that loses its owner loses
// only what it leased.
//
// What happens when things fail: a lease lasts LeaseTTL (what is left of it then is lost:
// the cluster admits a little less, never more). When a bucket's owner dies the ring names
// another, whose bucket starts full: the tenant may get one extra burst. In a partition
// each side's ring names its own owner, so each side admits the whole rate (a two-way
// split admits up to twice the limit until it heals). Tokens are charged as the prompt
// plus max_tokens at admission; what an answer did not use is credited back to the lease
// of the node that admitted it.
//
// A concurrency cap bounds a tenant's requests in flight on each node (not summed across
// the cluster: a cluster-wide count would put a hop on every request's end too).
package quota

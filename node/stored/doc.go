// Package stored keeps the Responses API's stored responses with their conversations.
//
// A stored response lives where its conversation's KV lives: on the conversation's owner
// (the node that served the turn), copied to the nodes that would take the conversation
// over (its KV replicas' nodes), handed to the next owner when this node leaves or the
// ring moves the conversation, and bounded in bytes and by a time to live. It outlives the
// KV: a follow-up whose cache was evicted runs cold, never 404. Each record is whole (the
// response and the conversation up to it), so any copy answers alone.
//
// A Keeper is both ends: it stores, fetches and deletes on the right nodes over signed
// hops (hop.StoredPath), and serves those hops from its Store.
package stored

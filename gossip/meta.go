package gossip

import (
	"encoding/json"
	"fmt"

	"github.com/hashicorp/memberlist"
)

// Meta is what a node tells the cluster about itself. Encoded, it must fit memberlist's
// metadata limit (512 bytes): ids and addresses are short, load is a few integers.
type Meta struct {
	ID          string `json:"id"`    // stable node id (the memberlist name adds a per-start incarnation)
	HTTPAddr    string `json:"http"`  // host:port of the node's API
	Fingerprint string `json:"fp"`    // model and KV-layout fingerprint
	Ready       bool   `json:"ready"` // model loaded and warmed
	Running     int    `json:"run,omitempty"`
	Waiting     int    `json:"wait,omitempty"`
	FreeKV      int    `json:"kvfree,omitempty"`
	QueueCap    int    `json:"qcap,omitempty"` // waiting requests the node accepts before refusing
	Leaving     bool   `json:"leaving,omitempty"`
}

// Full reports whether the node's gossiped load says it would refuse a new request.
func (m Meta) Full() bool { return m.QueueCap > 0 && m.Waiting >= m.QueueCap }

// Encode returns m as bytes within memberlist's metadata limit.
func (m Meta) Encode() ([]byte, error) {
	b, err := json.Marshal(m)
	if err != nil {
		return nil, err
	}
	if len(b) > memberlist.MetaMaxSize {
		return nil, fmt.Errorf("gossip metadata is %d bytes, over memberlist's %d (shorten the id or address)", len(b), memberlist.MetaMaxSize)
	}
	return b, nil
}

// DecodeMeta parses metadata received from a peer.
func DecodeMeta(b []byte) (Meta, error) {
	var m Meta
	err := json.Unmarshal(b, &m)
	return m, err
}

package routing

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/infernode/infernode/gossip"
)

// Meta is what a node tells the cluster about itself: routing's schema of the tags gossip
// carries (gossip knows nothing of models). Encoded, it must fit gossip.MaxTags (512
// bytes): ids and addresses are short, load is a few integers.
type Meta struct {
	ID          string `json:"id"`              // stable node id (the memberlist name adds a per-start incarnation)
	HTTPAddr    string `json:"http"`            // host:port of the node's API
	Fingerprint string `json:"fp"`              // model and KV-layout fingerprint
	Model       string `json:"model,omitempty"` // the model's id, as clients name it
	Ready       bool   `json:"ready"`           // model loaded and warmed
	Running     int    `json:"run,omitempty"`
	Waiting     int    `json:"wait,omitempty"`
	FreeKV      int    `json:"kvfree,omitempty"`
	KVActive    int    `json:"kvact,omitempty"` // KV cells of running requests (the autoscaler's input)
	KVCells     int    `json:"kv,omitempty"`    // KV cells in all
	QueueCap    int    `json:"qcap,omitempty"`  // waiting requests the node accepts before refusing
	Slots       int    `json:"seq,omitempty"`   // sequence slots: requests it runs at once
	Prefill     int    `json:"pf,omitempty"`    // prompt tokens it prefills a second at its recent load (0: unknown)
	Decode      int    `json:"tps,omitempty"`   // tokens it generated a second lately
	Leaving     bool   `json:"leaving,omitempty"`
	Role        string `json:"role,omitempty"` // RolePrefill or RoleDecode (none: RoleBoth)
	Hop         []int  `json:"hop,omitempty"`  // major versions of the hop protocol the node speaks
	HopMinor    int    `json:"hopv,omitempty"` // the minor version of the newest (since hop 1.4; absent: 3 or less)
	// Slow lists the peers this node finds slow (gray failures: they answer, slowly).
	Slow []string `json:"slow,omitempty"`
}

// withoutLoad is m with the fields that change with load zeroed.
func (m Meta) withoutLoad() Meta {
	m.Running, m.Waiting, m.FreeKV, m.KVActive, m.Prefill, m.Decode = 0, 0, 0, 0, 0, 0
	return m
}

// same reports whether m and o say the same.
func (m Meta) same(o Meta) bool {
	a, errA := m.Encode()
	b, errB := o.Encode()
	return errA == nil && errB == nil && bytes.Equal(a, b)
}

// Full reports whether the node's gossiped load says it would refuse a new request.
func (m Meta) Full() bool { return m.QueueCap > 0 && m.Waiting >= m.QueueCap }

// Encode returns m as bytes within memberlist's metadata limit.
func (m Meta) Encode() ([]byte, error) {
	b, err := json.Marshal(m)
	if err != nil {
		return nil, err
	}
	if len(b) > gossip.MaxTags {
		return nil, fmt.Errorf("gossip metadata is %d bytes, over memberlist's %d (shorten the id or address)", len(b), gossip.MaxTags)
	}
	return b, nil
}

// DecodeMeta parses metadata received from a peer.
func DecodeMeta(b []byte) (Meta, error) {
	var m Meta
	err := json.Unmarshal(b, &m)
	return m, err
}

// Validate checks metadata received from the network before it can steer traffic: the id
// must be the one in the member's gossip name (ID#incarnation), and the HTTP address a
// plain host:port, with no scheme, path, query or user info that could turn a URL built
// from it into another.
func (m Meta) Validate(name string) error {
	id, _, ok := strings.Cut(name, "#")
	switch {
	case m.ID == "":
		return errors.New("metadata has no id")
	case !ok || id != m.ID:
		return fmt.Errorf("metadata id %q does not match member name %q", m.ID, name)
	}
	return gossip.ValidateHostPort(m.HTTPAddr)
}

// Speaks reports whether the node speaks major version v of the hop protocol.
func (m Meta) Speaks(v int) bool { return slices.Contains(m.Hop, v) }

// schema is Meta as gossip needs to know it (gossip.Schema).
type schema struct{}

func (schema) Validate(name string, tags []byte) error {
	m, err := DecodeMeta(tags)
	if err == nil {
		err = m.Validate(name)
	}
	return err
}

func (schema) Leaving(tags []byte) bool {
	m, err := DecodeMeta(tags)
	return err == nil && m.Leaving
}

func (schema) Leave(tags []byte) []byte {
	m, err := DecodeMeta(tags)
	if err != nil {
		return tags
	}
	m.Leaving = true
	if b, err := m.Encode(); err == nil {
		return b
	}
	return tags
}

// Urgent: anything but load changed (readiness, leaving, slow peers), or the queue filled
// or emptied.
func (schema) Urgent(sent, next []byte) bool {
	a, errA := DecodeMeta(sent)
	b, errB := DecodeMeta(next)
	return errA != nil || errB != nil || !a.withoutLoad().same(b.withoutLoad()) || a.Full() != b.Full()
}

// Schema is routing's schema for gossip's tags: gossip.Config.Schema.
var Schema gossip.Schema = schema{}

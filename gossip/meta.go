package gossip

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"slices"
	"strconv"
	"strings"

	"github.com/hashicorp/memberlist"
)

// Meta is what a node tells the cluster about itself. Encoded, it must fit memberlist's
// metadata limit (512 bytes): ids and addresses are short, load is a few integers.
type Meta struct {
	ID          string `json:"id"`              // stable node id (the memberlist name adds a per-start incarnation)
	HTTPAddr    string `json:"http"`            // host:port of the node's API
	Fingerprint string `json:"fp"`              // model and KV-layout fingerprint
	Model       string `json:"model,omitempty"` // the model's id, as clients name it
	Ready       bool   `json:"ready"`           // model loaded and warmed
	Running     int    `json:"run,omitempty"`
	Waiting     int    `json:"wait,omitempty"`
	FreeKV      int    `json:"kvfree,omitempty"`
	QueueCap    int    `json:"qcap,omitempty"` // waiting requests the node accepts before refusing
	Prefill     int    `json:"pf,omitempty"`   // prompt tokens it prefills a second at its recent load (0: unknown)
	Decode      int    `json:"tps,omitempty"`  // tokens it generated a second lately
	Leaving     bool   `json:"leaving,omitempty"`
	Hop         []int  `json:"hop,omitempty"` // major versions of the hop protocol the node speaks
	// Slow lists the peers this node finds slow (gray failures: they answer, slowly).
	Slow []string `json:"slow,omitempty"`
}

// withoutLoad is m with the fields that change with load zeroed.
func (m Meta) withoutLoad() Meta {
	m.Running, m.Waiting, m.FreeKV, m.Prefill, m.Decode = 0, 0, 0, 0, 0
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
	return ValidateHostPort(m.HTTPAddr)
}

// ValidateHostPort accepts host:port and nothing else: a host name or IP address and a port
// in 1-65535.
func ValidateHostPort(addr string) error {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("address %q is not host:port: %w", addr, err)
	}
	if host == "" || strings.ContainsAny(host, "/?#@%\\ \t\r\n") {
		return fmt.Errorf("address %q: bad host", addr)
	}
	if p, err := strconv.Atoi(port); err != nil || p < 1 || p > 65535 || strconv.Itoa(p) != port {
		return fmt.Errorf("address %q: bad port", addr)
	}
	return nil
}

// Speaks reports whether the node speaks major version v of the hop protocol.
func (m Meta) Speaks(v int) bool { return slices.Contains(m.Hop, v) }

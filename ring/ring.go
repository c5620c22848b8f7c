package ring

import (
	"errors"
	"fmt"
	"slices"

	"github.com/buraksezer/consistent"
	"github.com/cespare/xxhash/v2"
)

// Config shapes the ring and the health hysteresis.
type Config struct {
	// PartitionCount is how many partitions keys hash into; partitions, not keys, are
	// assigned to peers. A prime well above the peer count. Default 7919.
	PartitionCount int
	// ReplicationFactor is the virtual nodes per peer. Default 150.
	ReplicationFactor int
	// Load bounds a peer's partitions at Load times the average. Default 1.25.
	Load float64
	// DownAfter consecutive failed checks take a peer off the ring. Default 3.
	DownAfter int
	// UpAfter consecutive successful checks put it back. Default 2.
	UpAfter int
}

// DefaultConfig returns infernode's ring settings.
func DefaultConfig() Config {
	return Config{PartitionCount: 7919, ReplicationFactor: 150, Load: 1.25, DownAfter: 3, UpAfter: 2}
}

// Validate reports every problem with c at once.
func (c Config) Validate() error {
	var errs []error
	if c.PartitionCount < 1 {
		errs = append(errs, fmt.Errorf("partition count must be positive, got %d", c.PartitionCount))
	}
	if c.ReplicationFactor < 1 {
		errs = append(errs, fmt.Errorf("replication factor must be positive, got %d", c.ReplicationFactor))
	}
	if c.Load <= 1 {
		errs = append(errs, fmt.Errorf("load must be above 1, got %v", c.Load))
	}
	if c.DownAfter < 1 || c.UpAfter < 1 {
		errs = append(errs, fmt.Errorf("down-after and up-after must be positive, got %d and %d", c.DownAfter, c.UpAfter))
	}
	return errors.Join(errs...)
}

// ErrNoOwner means the ring is empty: no peer, not even this node, may serve.
var ErrNoOwner = errors.New("ring has no members")

type hasher struct{}

func (hasher) Sum64(b []byte) uint64 { return xxhash.Sum64(b) }

type member string

func (m member) String() string { return string(m) }

// Ring is an immutable consistent-hash ring over a set of peer ids.
type Ring struct {
	c       *consistent.Consistent
	members []string
	parts   int
}

// New builds a ring over members (duplicates ignored).
func New(cfg Config, members []string) *Ring {
	ms := slices.Clone(members)
	slices.Sort(ms)
	ms = slices.Compact(ms)
	r := &Ring{members: ms, parts: cfg.PartitionCount}
	if len(ms) == 0 {
		return r
	}
	cm := make([]consistent.Member, len(ms))
	for i, m := range ms {
		cm[i] = member(m)
	}
	r.c = consistent.New(cm, consistent.Config{
		Hasher: hasher{}, PartitionCount: cfg.PartitionCount, ReplicationFactor: cfg.ReplicationFactor, Load: cfg.Load,
	})
	return r
}

// Members are the ring's peers, sorted.
func (r *Ring) Members() []string { return slices.Clone(r.members) }

// Owner is the peer that owns key.
func (r *Ring) Owner(key string) (string, bool) {
	if r.c == nil {
		return "", false
	}
	return r.c.LocateKey([]byte(key)).String(), true
}

// Owners are up to n peers for key: its owner first, then the peers that take over, in
// order, when the ones before them fail. It fails with ErrNoOwner when the ring is empty.
func (r *Ring) Owners(key string, n int) ([]string, error) {
	if r.c == nil {
		return nil, ErrNoOwner
	}
	if n < 1 {
		return nil, fmt.Errorf("owners of %q: want at least 1, asked for %d", key, n)
	}
	ms, err := r.c.GetClosestN([]byte(key), min(n, len(r.members)))
	if err != nil {
		return nil, fmt.Errorf("owners of %q: %w", key, err)
	}
	out := make([]string, len(ms))
	for i, m := range ms {
		out[i] = m.String()
	}
	return out, nil
}

// Shares is each member's fraction of the partitions (and so, on average, of keys).
func (r *Ring) Shares() map[string]float64 {
	out := map[string]float64{}
	if r.c == nil {
		return out
	}
	for id, load := range r.c.LoadDistribution() {
		out[id] = load / float64(r.parts)
	}
	return out
}

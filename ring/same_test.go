package ring

import (
	"fmt"
	"testing"

	"github.com/buraksezer/consistent"
	"github.com/cespare/xxhash/v2"
)

type hasher struct{}

func (hasher) Sum64(b []byte) uint64 { return xxhash.Sum64(b) }

type member string

func (m member) String() string { return string(m) }

// TestSameAsConsistent: the ring places every partition where
// github.com/buraksezer/consistent does, and lists the same successors, for the same
// members and settings (its settings before this package sped the build up, and today's).
func TestSameAsConsistent(t *testing.T) {
	for _, cfg := range []Config{DefaultConfig(), {PartitionCount: 7919, ReplicationFactor: 150, Load: 1.25}, {PartitionCount: 271, ReplicationFactor: 20, Load: 1.25}} {
		for _, n := range []int{1, 2, 3, 10, 40} {
			t.Run(fmt.Sprintf("%d-%d-%v-%d", cfg.PartitionCount, cfg.ReplicationFactor, cfg.Load, n), func(t *testing.T) {
				ms := make([]consistent.Member, n)
				for i, id := range ids(n) {
					ms[i] = member(id)
				}
				want := consistent.New(ms, consistent.Config{Hasher: hasher{}, PartitionCount: cfg.PartitionCount,
					ReplicationFactor: cfg.ReplicationFactor, Load: cfg.Load})
				got := New(cfg, ids(n))
				for p := range cfg.PartitionCount {
					if w, g := want.GetPartitionOwner(p).String(), got.members[got.owner[p]]; w != g {
						t.Fatalf("partition %d: owner %s, consistent says %s", p, g, w)
					}
				}
				for _, k := range keys(200) {
					w, err := want.GetClosestN([]byte(k), min(3, n))
					if err != nil {
						t.Fatal(err)
					}
					g, _ := got.Owners(k, 3)
					if fmt.Sprint(w) != fmt.Sprint(g) {
						t.Fatalf("owners of %s: %v, consistent says %v", k, g, w)
					}
				}
			})
		}
	}
}

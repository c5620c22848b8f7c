package ring

import (
	"fmt"
	"testing"

	"github.com/buraksezer/consistent"
)

// BenchmarkRing: what one membership change costs a node at each cluster size. build is a
// ring made from nothing (a node starting); join and leave are one peer's change applied
// to the live ring; storm is 100 peers joining in one update; owner and owners are the
// lookups every request makes.
//
//	go test ./ring -run '^$' -bench Ring -benchmem
func BenchmarkRing(b *testing.B) {
	cfg := DefaultConfig()
	for _, n := range []int{10, 100, 300, 1000} {
		members := ids(n)
		r := New(cfg, members)
		b.Run(fmt.Sprintf("build/%d", n), func(b *testing.B) {
			for b.Loop() {
				New(cfg, members)
			}
		})
		b.Run(fmt.Sprintf("join/%d", n), func(b *testing.B) {
			for b.Loop() {
				r.Apply([]string{"newcomer"}, nil)
			}
		})
		b.Run(fmt.Sprintf("leave/%d", n), func(b *testing.B) {
			for b.Loop() {
				r.Apply(nil, []string{"node1"})
			}
		})
		storm := make([]string, 100)
		for i := range storm {
			storm[i] = fmt.Sprintf("storm%d", i)
		}
		b.Run(fmt.Sprintf("storm100/%d", n), func(b *testing.B) {
			for b.Loop() {
				r.Apply(storm, nil)
			}
		})
		ks := keys(1024)
		b.Run(fmt.Sprintf("owner/%d", n), func(b *testing.B) {
			i := 0
			for b.Loop() {
				r.Owner(ks[i%len(ks)])
				i++
			}
		})
		b.Run(fmt.Sprintf("owners3/%d", n), func(b *testing.B) {
			i := 0
			for b.Loop() {
				r.Owners(ks[i%len(ks)], 3) // the ring is not empty: no error
				i++
			}
		})
	}
}

// BenchmarkConsistent is the library this package's placement follows, at its New and
// Add (one join on a live ring) for comparison. (At 1,000 peers its New takes about 8 s.)
//
//	go test ./ring -run '^$' -bench Consistent -benchtime 3x
func BenchmarkConsistent(b *testing.B) {
	cfg := DefaultConfig()
	ccfg := consistent.Config{Hasher: hasher{}, PartitionCount: cfg.PartitionCount, ReplicationFactor: cfg.ReplicationFactor, Load: cfg.Load}
	for _, n := range []int{10, 100, 300} {
		ms := make([]consistent.Member, n)
		for i, id := range ids(n) {
			ms[i] = member(id)
		}
		b.Run(fmt.Sprintf("new/%d", n), func(b *testing.B) {
			for b.Loop() {
				consistent.New(ms, ccfg)
			}
		})
		c := consistent.New(ms, ccfg)
		b.Run(fmt.Sprintf("add+remove/%d", n), func(b *testing.B) {
			for b.Loop() {
				c.Add(member("newcomer"))
				c.Remove("newcomer")
			}
		})
	}
}

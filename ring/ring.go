package ring

import (
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"sync"

	"github.com/cespare/xxhash/v2"
)

// Config shapes the ring and the health hysteresis.
type Config struct {
	// PartitionCount is how many partitions keys hash into; partitions, not keys, are
	// assigned to peers. A prime well above the peer count. Default 65521: about 65
	// partitions a peer at 1,000 peers, so whole-partition rounding adds under 2% to the
	// load bound (see docs/SCALE.md).
	PartitionCount int
	// ReplicationFactor is the virtual nodes per peer. Default 150.
	ReplicationFactor int
	// Load bounds a peer's partitions at Load times the average (rounded up to a whole
	// partition). Default 1.1: the largest share stays under 1.15x the mean from 3 to
	// 1,000 peers; lower bounds move more keys between peers that stayed on a join or
	// leave (docs/SCALE.md has both curves).
	Load float64
	// DownAfter consecutive failed checks take a peer off the ring. Default 3.
	DownAfter int
	// UpAfter consecutive successful checks put it back. Default 2.
	UpAfter int
}

// DefaultConfig returns infernode's ring settings.
func DefaultConfig() Config {
	return Config{PartitionCount: 65521, ReplicationFactor: 150, Load: 1.12, DownAfter: 3, UpAfter: 2}
}

// Validate reports every problem with c at once.
func (c Config) Validate() error {
	var errs []error
	if c.PartitionCount < 1 || c.PartitionCount > math.MaxInt32 {
		errs = append(errs, fmt.Errorf("partition count must be in 1..%d, got %d", math.MaxInt32, c.PartitionCount))
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

// Ring is an immutable consistent-hash ring with bounded loads over a set of peer ids:
// github.com/buraksezer/consistent's algorithm and placement (each peer's virtual nodes
// at xxhash("i:id"), partition p at xxhash of p as 8 little-endian bytes, each partition
// in id order to the first virtual node clockwise whose peer holds fewer than
// ceil(partitions/peers*Load); TestSameAsConsistent compares them partition by
// partition), built in O(V log V) for V virtual nodes instead of the library's
// O(n·V log V), and changed incrementally by Apply. Readers need no lock: a change makes
// a new Ring.
type Ring struct {
	cfg     Config
	members []string // sorted
	vnodes  []vnode  // sorted by hash, then member
	owner   []int32  // partition → index in members
	loads   []int32  // partitions each member holds
	// byName are the member indexes ordered by the hash of their ids: Owners' order
	// after the owner (consistent's GetClosestN); at[m] is m's place in it.
	byName []int32
	at     []int32
}

type vnode struct {
	hash uint64
	m    int32 // index in members
}

// New builds a ring over members (duplicates ignored).
func New(cfg Config, members []string) *Ring {
	return (&Ring{cfg: cfg}).Apply(members, nil)
}

// Apply returns the ring with the peers in add joined and those in remove gone (ids not
// on the ring are ignored; an id in both stays). The result depends only on the final set
// of members, never on the order of changes that led to it: only the new peers' virtual
// nodes are hashed and merged, and then every partition is assigned again.
func (r *Ring) Apply(add, remove []string) *Ring {
	gone := make(map[string]bool, len(remove))
	for _, id := range remove {
		gone[id] = !slices.Contains(add, id)
	}
	members := make([]string, 0, len(r.members)+len(add))
	for _, id := range r.members {
		if !gone[id] {
			members = append(members, id)
		}
	}
	var fresh []string
	for _, id := range add {
		if _, found := slices.BinarySearch(r.members, id); !found {
			fresh = append(fresh, id)
		}
	}
	slices.Sort(fresh)
	fresh = slices.Compact(fresh)
	members = append(members, fresh...)
	slices.Sort(members)
	if slices.Equal(members, r.members) {
		return r
	}
	index := func(id string) int32 {
		i, _ := slices.BinarySearch(members, id)
		return int32(i)
	}
	// Keep the virtual nodes of peers that stay (still sorted), with their new indexes.
	remap := make([]int32, len(r.members))
	for i, id := range r.members {
		remap[i] = -1
		if !gone[id] {
			remap[i] = index(id)
		}
	}
	kept := make([]vnode, 0, len(r.vnodes))
	for _, v := range r.vnodes {
		if m := remap[v.m]; m >= 0 {
			kept = append(kept, vnode{v.hash, m})
		}
	}
	added := make([]vnode, 0, len(fresh)*r.cfg.ReplicationFactor)
	var key []byte
	for _, id := range fresh {
		m := index(id)
		for i := range r.cfg.ReplicationFactor {
			key = append(strconv.AppendInt(key[:0], int64(i), 10), ':')
			key = append(key, id...)
			added = append(added, vnode{xxhash.Sum64(key), m})
		}
	}
	slices.SortFunc(added, compareVnodes)
	out := &Ring{cfg: r.cfg, members: members, vnodes: mergeVnodes(kept, added)}
	out.distribute()
	return out
}

func compareVnodes(a, b vnode) int {
	if c := cmp.Compare(a.hash, b.hash); c != 0 {
		return c
	}
	return cmp.Compare(a.m, b.m)
}

func mergeVnodes(a, b []vnode) []vnode {
	out := make([]vnode, 0, len(a)+len(b))
	for len(a) > 0 && len(b) > 0 {
		if compareVnodes(a[0], b[0]) <= 0 {
			out, a = append(out, a[0]), a[1:]
		} else {
			out, b = append(out, b[0]), b[1:]
		}
	}
	return append(append(out, a...), b...)
}

// distribute assigns every partition and orders the members for Owners.
func (r *Ring) distribute() {
	n := len(r.members)
	r.loads = make([]int32, n)
	r.byName = make([]int32, n)
	r.at = make([]int32, n)
	if n == 0 {
		return
	}
	hashes := make([]uint64, n)
	for i, id := range r.members {
		hashes[i] = xxhash.Sum64String(id)
		r.byName[i] = int32(i)
	}
	slices.SortFunc(r.byName, func(a, b int32) int { return cmp.Compare(hashes[a], hashes[b]) })
	for i, m := range r.byName {
		r.at[m] = int32(i)
	}
	// The same expression as consistent's averageLoad, so the bound rounds alike.
	bound := int32(math.Ceil(float64(r.cfg.PartitionCount) / float64(n) * r.cfg.Load))
	parts := partitionsOf(r.cfg.PartitionCount)
	vs := r.vnodes
	// Where each partition's walk starts: the first virtual node at or after its hash,
	// found for all partitions in one sweep of both sorted lists.
	start := make([]int32, len(parts.hash))
	i := 0
	for _, p := range parts.byHash {
		for i < len(vs) && vs[i].hash < parts.hash[p] {
			i++
		}
		start[p] = int32(i)
	}
	r.owner = make([]int32, len(parts.hash))
	for p := range parts.hash {
		i := int(start[p])
		for range vs { // bound*n ≥ partitions, so some member always has room
			if i == len(vs) {
				i = 0
			}
			if m := vs[i].m; r.loads[m] < bound {
				r.owner[p] = m
				r.loads[m]++
				break
			}
			i++
		}
	}
}

// partitions are the ring positions of partitions 0..count-1, and the partitions in the
// order of their positions.
type partitions struct {
	hash   []uint64
	byHash []int32
}

var partitionCache sync.Map // partition count → *partitions

// partitionsOf computes a partition count's positions once.
func partitionsOf(count int) *partitions {
	if ps, ok := partitionCache.Load(count); ok {
		return ps.(*partitions)
	}
	ps := &partitions{hash: make([]uint64, count), byHash: make([]int32, count)}
	var b [8]byte
	for p := range ps.hash {
		binary.LittleEndian.PutUint64(b[:], uint64(p))
		ps.hash[p] = xxhash.Sum64(b[:])
		ps.byHash[p] = int32(p)
	}
	slices.SortFunc(ps.byHash, func(a, b int32) int { return cmp.Compare(ps.hash[a], ps.hash[b]) })
	partitionCache.Store(count, ps)
	return ps
}

// Members are the ring's peers, sorted.
func (r *Ring) Members() []string { return slices.Clone(r.members) }

// Len is the number of peers on the ring.
func (r *Ring) Len() int {
	if r == nil {
		return 0
	}
	return len(r.members)
}

// Has reports whether id is on the ring.
func (r *Ring) Has(id string) bool {
	if r == nil {
		return false
	}
	_, ok := slices.BinarySearch(r.members, id)
	return ok
}

func (r *Ring) partition(key string) int {
	return int(xxhash.Sum64String(key) % uint64(r.cfg.PartitionCount))
}

// Owner is the peer that owns key.
func (r *Ring) Owner(key string) (string, bool) {
	if len(r.members) == 0 {
		return "", false
	}
	return r.members[r.owner[r.partition(key)]], true
}

// Owners are up to n peers for key: its owner first, then the peers that take over, in
// order, when the ones before them fail. It fails with ErrNoOwner when the ring is empty.
func (r *Ring) Owners(key string, n int) ([]string, error) {
	if len(r.members) == 0 {
		return nil, ErrNoOwner
	}
	if n < 1 {
		return nil, fmt.Errorf("owners of %q: want at least 1, asked for %d", key, n)
	}
	n = min(n, len(r.members))
	out := make([]string, n)
	at := int(r.at[r.owner[r.partition(key)]])
	for i := range out {
		out[i] = r.members[r.byName[(at+i)%len(r.byName)]]
	}
	return out, nil
}

// Neighbours are the peers up to k places after id in Owners' order (they take over its
// keys when it fails) and up to k places before it (it takes over theirs), without id
// and without repeats; none if id is not on the ring.
func (r *Ring) Neighbours(id string, k int) []string {
	m, ok := slices.BinarySearch(r.members, id)
	if !ok {
		return nil
	}
	n := len(r.byName)
	var out []string
	for d := 1; d <= k && len(out) < n-1; d++ {
		for _, at := range []int{int(r.at[m]) + d, int(r.at[m]) - d + n} {
			if nb := r.members[r.byName[at%n]]; nb != id && !slices.Contains(out, nb) {
				out = append(out, nb)
			}
		}
	}
	return out
}

// Sample is the owner at n points evenly spaced around the key space (partition i of p
// at i/p of the circle, where the keys that hash to it lie): the ring drawn coarsely (nil for an empty ring or n < 1).
func (r *Ring) Sample(n int) []string {
	if r.Len() == 0 || n < 1 {
		return nil
	}
	count := len(r.owner)
	out := make([]string, n)
	for i := range out {
		out[i] = r.members[r.owner[i*count/n]]
	}
	return out
}

// Shares is each member's fraction of the partitions (and so, on average, of keys).
func (r *Ring) Shares() map[string]float64 {
	out := make(map[string]float64, r.Len())
	if r == nil {
		return out
	}
	for i, id := range r.members {
		out[id] = float64(r.loads[i]) / float64(r.cfg.PartitionCount)
	}
	return out
}

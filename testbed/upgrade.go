package testbed

import (
	"fmt"
	"time"
)

// A rolling upgrade: the cluster starts on one binary (Config.Binary) and every node in
// turn leaves gracefully and comes back on another (Config.Upgrade), under chat load.

// Upgrade is the rolling-upgrade scenario for nodes nodes: planned's six-turn
// conversations throughout, each node replaced in turn (a leave, then the new binary 4s
// later), and 8s of load after the last one, when every node runs the new binary.
func Upgrade(seed uint64, nodes int) Scenario {
	const step = 9 * time.Second // a leave's drain and a restart's join, with room to settle
	w := planned(seed)
	var faults []Fault
	for i := range nodes {
		at := time.Second + time.Duration(i)*step
		faults = append(faults, Fault{At: at, Kind: "leave", Node: i},
			Fault{At: at + 4*time.Second, Kind: "upgrade", Node: i, Detect: 15 * time.Second})
	}
	w.Duration = time.Second + time.Duration(nodes)*step + 8*time.Second
	return Scenario{Name: "upgrade", Nodes: nodes, Workload: w, MaxFailures: 0, NoResumes: true, MinAffinity: 3,
		Doc:    fmt.Sprintf("every one of %d nodes in turn leaves (SIGTERM) and comes back on the new binary, under chat load", nodes),
		Faults: faults}
}

// upgradeSettle is how long after the last upgraded node is back on every ring its
// conversations may still be on their way to it (pushed once its ring has been quiet for
// 300ms, or pulled on their next turn).
const upgradeSettle = time.Second

// checkUpgraded: once the last node is back on the new binary, every follow-up turn runs
// warm, wherever its conversation's earlier turns ran and on whichever binary.
func (c *Cluster) checkUpgraded(rep *Report) {
	var last time.Time
	for _, a := range rep.Faults {
		if a.Fault.Kind == "upgrade" && a.Err == "" {
			last = a.Time.Add(a.Detection + upgradeSettle)
		}
	}
	if last.IsZero() {
		return
	}
	followUps, warm := 0, 0
	var cold []string
	for _, r := range rep.Records {
		if r.Kind != "ok" || r.Turn == 0 || !r.Start.After(last) {
			continue
		}
		followUps++
		if r.Cached > 0 {
			warm++
		} else {
			cold = append(cold, fmt.Sprintf("conv %d turn %d via %s on %s", r.Conv, r.Turn, r.Entry, r.Served))
		}
	}
	rep.Checks = append(rep.Checks, Check{Name: "every follow-up after the last upgrade is warm", Pass: followUps > 0 && len(cold) == 0,
		Detail: fmt.Sprintf("%d of %d follow-ups warm after %v; cold: %v", warm, followUps, last.Sub(rep.Started).Round(time.Millisecond), firstN(cold, 5))})
}

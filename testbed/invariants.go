package testbed

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"os"
	"slices"
	"sort"
	"strings"
	"syscall"
	"time"
)

// Invariants: what a chaos run must show once its load is over. Each check adds a Check
// to the report.

// checkDetection: every measured fault was seen by every other ring within its bound, and
// every healing was too. A measurement cut short by the next fault is a failure: the
// schedule must leave room for it.
func (c *Cluster) checkDetection(rep *Report) {
	var bad []string
	var seen []string
	for _, a := range rep.Faults {
		switch {
		case a.Err != "" || a.DetectErr != "":
			bad = append(bad, fmt.Sprintf("%s: %s%s", a.Fault, a.Err, a.DetectErr))
		case !a.Measured:
		case a.Detection > detectBound(a.Fault):
			bad = append(bad, fmt.Sprintf("%s: rings agreed after %v, bound %v", a.Fault, a.Detection.Round(time.Millisecond), detectBound(a.Fault)))
		default:
			rep.Detections++
			seen = append(seen, fmt.Sprintf("%s %v", a.Fault.Kind, a.Detection.Round(time.Millisecond)))
		}
	}
	rep.Checks = append(rep.Checks, Check{Name: "every fault and healing is detected in bounded time", Pass: len(bad) == 0,
		Detail: fmt.Sprintf("%d detections within bounds %v; failed: %v", rep.Detections, seen, bad)})
}

// checkRecords: nothing hung; every failure is explained (it entered on a node faulted at
// that moment, or it is a 503 with Retry-After) and there are no more than the scenario
// allows; enough answers resumed; every answer says it took at most one hop.
func (c *Cluster) checkRecords(rep *Report, s Scenario) {
	var unexplained, hops []string
	for _, r := range rep.Records {
		rep.Sent++
		switch r.Kind {
		case "ok":
			rep.Completed++
			if r.Resumed {
				rep.Resumed++
			}
			if r.Hops < 0 || r.Hops > 1 {
				hops = append(hops, fmt.Sprintf("conv %d turn %d via %s: %d hops", r.Conv, r.Turn, r.Entry, r.Hops))
			}
			continue
		case "hung":
			rep.Hung++
		}
		rep.Failed++
		busy := r.Status == 503 && r.Retry
		if !busy && !faulted(rep.Windows, r.Entry, r.Start, r.End) {
			unexplained = append(unexplained, fmt.Sprintf("conv %d turn %d via %s (untouched): %s %d %s", r.Conv, r.Turn, r.Entry, r.Kind, r.Status, r.Error))
		}
	}
	rep.Checks = append(rep.Checks,
		Check{Name: "no request hangs", Pass: rep.Hung == 0, Detail: fmt.Sprintf("%d of %d requests outlived the deadline", rep.Hung, rep.Sent)},
		Check{Name: "every failure is explained and within the ceiling", Pass: len(unexplained) == 0 && rep.Failed <= s.MaxFailures,
			Detail: fmt.Sprintf("%d failed (ceiling %d), %d unexplained: %v", rep.Failed, s.MaxFailures, len(unexplained), firstN(unexplained, 5))},
		Check{Name: "enough answers resumed mid-stream", Pass: rep.Resumed >= s.MinResumes && (!s.NoResumes || rep.Resumed == 0),
			Detail: fmt.Sprintf("%d resumed (minimum %d, none allowed: %v)", rep.Resumed, s.MinResumes, s.NoResumes)},
		Check{Name: "every answer took at most one hop", Pass: len(hops) == 0,
			Detail: fmt.Sprintf("%d answers checked; bad: %v", rep.Completed, firstN(hops, 5))})
}

// kvPaths are the ways a conversation's KV moves between nodes, as nodes name them
// (infer.Origin, X-Infernode-KV-Source, infernode_kv_imports_total's origin).
var kvPaths = []string{"replica", "handoff", "push", "pull"}

// moves counts the conversations each KV path moved in a run, from the cluster's own
// records. A replica is copied after every turn, so it counts only when a turn was served
// from it (the answer's X-Infernode-KV-Source); a hand-off, a push or a pull is a move
// whenever a node installs one (infernode_kv_imports_total on the nodes running at the
// end: a node that left or restarted took its own count with it).
func (c *Cluster) moves(rep *Report) map[string]int {
	out := map[string]int{}
	for _, r := range rep.Records {
		if r.Kind == "ok" && r.Source == "replica" {
			out["replica"]++
		}
	}
	for _, n := range c.running() {
		for _, path := range kvPaths[1:] {
			v, _ := c.Metric(n, fmt.Sprintf(`infernode_kv_imports_total{origin=%q}`, path))
			out[path] += int(v)
		}
	}
	return out
}

// checkWarm: every KV path the scenario exercises moved at least its minimum of
// conversations (Scenario.MinMoved), and a conversation moved by a change resumes from
// cache on its new owner: its next turn reports cached tokens. A leaving node hands its
// caches off and its replicas are already there, so every such turn after a leave must be
// warm; a node that joined or came back has the conversations it now owns pushed to it, or
// pulls one on its first miss, so every such turn after a join must be warm too. After a
// crash the replica is the only copy; a turn that finds none (skipped while transfers were
// busy) is counted, not failed.
func (c *Cluster) checkWarm(rep *Report, s Scenario) {
	byConv := map[int][]Record{}
	for _, r := range rep.Records {
		if r.Kind == "ok" {
			byConv[r.Conv] = append(byConv[r.Conv], r)
		}
	}
	var cold []string
	leaves, leavesWarm, joins, joinsWarm, crashes, crashesWarm := 0, 0, 0, 0, 0, 0
	for _, a := range rep.Faults {
		kind := a.Fault.Kind
		joinLike := kind == "join" || kind == "upgrade" || kind == "restart"
		if a.Err != "" || (kind != "leave" && kind != "kill" && !joinLike) {
			continue
		}
		id := c.Nodes[a.Fault.Node].ID
		back := a.Time.Add(a.Detection) // a joining node is an owner once every ring has it
		for conv, recs := range byConv {
			slices.SortFunc(recs, func(x, y Record) int { return x.Turn - y.Turn })
			for i := 1; i < len(recs); i++ {
				prev, next := recs[i-1], recs[i]
				if next.Turn != prev.Turn+1 || !next.Start.After(a.Time) || prev.Start.After(a.Time) {
					continue
				}
				warm := next.Cached > 0
				switch {
				case kind == "leave" && prev.Served == id && next.Served != id:
					leaves++
					if warm {
						leavesWarm++
					} else {
						cold = append(cold, fmt.Sprintf("conv %d turn %d on %s after %s left: 0 cached", conv, next.Turn, next.Served, id))
					}
				case joinLike && prev.Served != id && next.Served == id && next.Start.After(back):
					joins++
					if warm {
						joinsWarm++
					} else if kind != "upgrade" { // an older peer's pull answer cannot be verified: it is not asked
						cold = append(cold, fmt.Sprintf("conv %d turn %d on %s after its %s: 0 cached", conv, next.Turn, id, kind))
					}
				case kind == "kill" && prev.Served == id && next.Served != id:
					crashes++
					if warm {
						crashesWarm++
					}
				}
			}
		}
	}
	rep.Moved = c.moves(rep)
	var short []string
	for _, path := range kvPaths {
		if min := s.MinMoved[path]; rep.Moved[path] < min {
			short = append(short, fmt.Sprintf("%s %d (minimum %d)", path, rep.Moved[path], min))
		}
	}
	rep.Checks = append(rep.Checks,
		Check{Name: "every KV path the faults exercise moves conversations", Pass: len(short) == 0,
			Detail: fmt.Sprintf("moved by replica %d, hand-off %d, push %d, pull %d (minimums %v); short: %v",
				rep.Moved["replica"], rep.Moved["handoff"], rep.Moved["push"], rep.Moved["pull"], s.MinMoved, short)},
		Check{Name: "conversations moved by a change resume warm", Pass: len(cold) == 0,
			Detail: fmt.Sprintf("after a leave %d of %d warm; after a join or return %d of %d warm; after a crash %d of %d warm (not failed: from replicas, skipped while transfers are busy); cold: %v",
				leavesWarm, leaves, joinsWarm, joins, crashesWarm, crashes, firstN(cold, 5))})
}

// flip is a span around a moment a node's view of the cluster marked member degraded or
// restored it (see node/gray).
type flip struct {
	member   string
	from, to time.Time
}

// degradedFlips are the spans around each such moment: the member's conversations may
// move then, their KV handed over within a second or two. Only its own: a degraded member
// goes after the other owners of its keys, which leaves every other key where it was.
func degradedFlips(samples []RingSample) []flip {
	type pair struct{ node, member string }
	marked := map[pair]bool{}
	var out []flip
	add := func(member string, at time.Time) {
		out = append(out, flip{member, at.Add(-time.Second), at.Add(2 * time.Second)})
	}
	for _, rs := range samples { // in time order for each node
		for _, id := range rs.Degraded {
			if p := (pair{rs.Node, id}); !marked[p] {
				marked[p] = true
				add(id, rs.Time)
			}
		}
		for p := range marked {
			if p.node == rs.Node && !slices.Contains(rs.Degraded, p.member) {
				delete(marked, p)
				add(p.member, rs.Time)
			}
		}
	}
	return out
}

// checkAffinity: a conversation whose turns all ran while the rings were converged (no
// fault or healing in progress, so every ring was the same) and whose owner was untouched
// keeps one serving node. Faults move conversations only while rings change.
func (c *Cluster) checkAffinity(rep *Report, s Scenario) {
	if s.Overload != nil {
		rep.Checks = append(rep.Checks, Check{Name: "conversations keep their owner while the rings are settled", Pass: true,
			Detail: "not checked: under overload a busy owner's turns spill to the next owners, by design"})
		return
	}
	// Spans in which rings may disagree or change: from each fault until every ring agreed
	// (or, for faults the rings do not see, until their healing was seen).
	var unsettled [][2]time.Time
	for _, a := range rep.Faults {
		if a.Measured {
			unsettled = append(unsettled, [2]time.Time{a.Time, a.Time.Add(a.Detection)})
		}
	}
	for _, w := range rep.Windows {
		switch w.Kind {
		case "loss", "oneway", "halves":
			unsettled = append(unsettled, [2]time.Time{w.From, w.To}) // rings may flap throughout
		case "bandwidth", "delay", "slowlink", "cpu":
			// So may they on a slow network, unless the scenario holds that none lost a
			// member (checkSteady); then only the slow nodes' own conversations (faulted,
			// below) and a degraded member's (flips) are left out.
			if !s.Steady {
				unsettled = append(unsettled, [2]time.Time{w.From, w.To})
			}
		}
	}
	// A node found slow (loss and delay make one so too) is degraded: it hands most of
	// its conversations to their next owners, and takes them back once restored, some
	// seconds after it recovered. Its conversations move at those two moments; one none of
	// whose turns it served stays where it is.
	flips := degradedFlips(rep.Rings)
	// unsettledBy names why a conversation is left out, or is "" when it is checked.
	unsettledBy := func(rs []Record) string {
		from, to := rs[0].Start, rs[len(rs)-1].End
		for _, u := range unsettled {
			if overlaps(from, to, u[0], u[1]) {
				return "rings changing"
			}
		}
		for _, f := range flips {
			served := slices.ContainsFunc(rs, func(r Record) bool { return r.Served == f.member })
			if served && overlaps(from, to, f.from, f.to) {
				return "served by a member while it was degraded or restored"
			}
		}
		if faulted(rep.Windows, rs[0].Served, from, to) {
			return "owner faulted"
		}
		// A node cut off serves what enters at it on its own ring: a turn that entered at
		// it, or was served by it, while it was isolated moved by design.
		for _, w := range rep.Windows {
			if w.Kind == "isolate" && slices.ContainsFunc(rs, func(r Record) bool {
				return (r.Entry == w.Node || r.Served == w.Node) && overlaps(r.Start, r.End, w.From, w.To)
			}) {
				return "entered at a node cut off"
			}
		}
		return ""
	}
	byConv := map[int][]Record{}
	for _, r := range rep.Records {
		if r.Kind == "ok" {
			byConv[r.Conv] = append(byConv[r.Conv], r)
		}
	}
	var bad []string
	left := map[string]int{}
	for conv, rs := range byConv {
		if len(rs) < 2 {
			continue
		}
		if why := unsettledBy(rs); why != "" {
			left[why]++
			continue
		}
		rep.Affinity++
		for _, r := range rs[1:] {
			if r.Served != rs[0].Served {
				var turns []string
				for _, t := range rs {
					turns = append(turns, fmt.Sprintf("turn %d at %v via %s on %s", t.Turn, t.Start.Sub(rep.Started).Round(time.Millisecond), t.Entry, t.Served))
				}
				bad = append(bad, fmt.Sprintf("conv %d: %v", conv, turns))
				break
			}
		}
	}
	rep.AffinityBad = len(bad)
	rep.Checks = append(rep.Checks, Check{Name: "conversations keep their owner while the rings are settled",
		Pass:   len(bad) == 0 && rep.Affinity >= s.MinAffinity,
		Detail: fmt.Sprintf("%d conversations checked (minimum %d), %d moved: %v; left out: %v", rep.Affinity, s.MinAffinity, len(bad), firstN(bad, 5), left)})
}

func firstN(s []string, n int) []string {
	sort.Strings(s)
	return s[:min(n, len(s))]
}

// usage is what a node holds at rest.
type usage struct{ goroutines, heap float64 }

// baselines warms each node (a request from every other node's side, so connection pools
// exist) and records what it holds at rest.
func (c *Cluster) baselines(ctx context.Context, nodes ...*Node) map[string]usage {
	out := map[string]usage{}
	client := &http.Client{Timeout: time.Minute}
	for _, n := range nodes {
		for i := range 2 {
			request(ctx, client, n, []message{{"user", fmt.Sprint("warm up ", i)}}, 4, i == 0, time.Minute, nil, "")
		}
	}
	for _, n := range nodes {
		g, err1 := c.Metric(n, "go_goroutines")
		h, err2 := c.Metric(n, "go_memstats_heap_inuse_bytes")
		if err1 == nil && err2 == nil {
			out[n.ID] = usage{g, h}
		}
	}
	return out
}

// checkIdle: every running node goes back to no running or waiting sequences, and to
// within a handful of goroutines and a bounded heap of its own baseline.
func (c *Cluster) checkIdle(ctx context.Context, rep *Report, baseline map[string]usage, nodes []*Node) {
	var problems, fine []string
	for _, n := range nodes {
		b, ok := baseline[n.ID]
		if !ok {
			problems = append(problems, n.ID+": no baseline")
			continue
		}
		// fasthttp sweeps its idle workers every 10 s and ends those idle over 10 s, so a
		// burst's workers last up to 20 s (a CI run failed at 15 s with 17 goroutines over
		// the baseline; at 15 s, a run's extra stacks were fasthttp's idle workers and
		// pooled connections). Peers' KV pools keep up to Transfers connections each for a
		// minute: within leakGoroutines.
		deadline := time.Now().Add(25 * time.Second)
		for {
			run, err1 := c.Metric(n, "infernode_running_sequences")
			wait, err2 := c.Metric(n, "infernode_waiting_requests")
			g, err3 := c.Metric(n, "go_goroutines")
			h, err4 := c.Metric(n, "go_memstats_heap_inuse_bytes")
			err := errors.Join(err1, err2, err3, err4)
			if err == nil && run == 0 && wait == 0 && g <= b.goroutines+leakGoroutines && h <= b.heap+leakHeap {
				fine = append(fine, fmt.Sprintf("%s %+.0f goroutines %+.0f MB", n.ID, g-b.goroutines, (h-b.heap)/1e6))
				break
			}
			if err != nil || time.Now().After(deadline) || ctx.Err() != nil {
				problem := fmt.Sprintf("%s: running %v, waiting %v, goroutines %v (baseline %v), heap %.0f MB (baseline %.0f MB) %v",
					n.ID, run, wait, g, b.goroutines, h/1e6, b.heap/1e6, errText(err))
				// The evidence: Go's runtime writes every goroutine's stack to the node's
				// log when it quits on SIGQUIT (no later check asks this node anything).
				if err == nil && n.signal(syscall.SIGQUIT) == nil && n.wait(10*time.Second) {
					problem += fmt.Sprintf("; goroutines by the function that started them: %s (stacks in %s)", goroutineCreators(n.logPath(), 6), n.logPath())
				}
				problems = append(problems, problem)
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	rep.Checks = append(rep.Checks, Check{Name: "nodes return to idle, nothing leaks", Pass: len(problems) == 0,
		Detail: fmt.Sprintf("%d nodes back to their baselines %v; problems: %v", len(fine), fine, problems)})
}

// goroutineCreators summarises the goroutine dump Go's runtime wrote at the end of a log
// on SIGQUIT: the top functions that started the goroutines, with their counts, most
// first.
func goroutineCreators(log string, top int) string {
	b, err := os.ReadFile(log)
	if err != nil {
		return err.Error()
	}
	i := bytes.LastIndex(b, []byte("SIGQUIT"))
	if i < 0 {
		return "no goroutine dump in the log"
	}
	counts := map[string]int{}
	for line := range strings.Lines(string(b[i:])) {
		if f, ok := strings.CutPrefix(line, "created by "); ok {
			f, _, _ = strings.Cut(strings.TrimSpace(f), " in goroutine ")
			counts[f]++
		}
	}
	creators := slices.SortedFunc(maps.Keys(counts), func(a, b string) int {
		return cmp.Or(counts[b]-counts[a], strings.Compare(a, b))
	})
	var out []string
	for _, f := range creators[:min(top, len(creators))] {
		out = append(out, fmt.Sprintf("%d %s", counts[f], f))
	}
	return strings.Join(out, ", ")
}

// nearTie is the largest gap in log probability between the most likely token and the one
// an answer took instead that floating-point differences may explain: llama.cpp computes a
// token's logits with different kernels and summation orders when it is prefilled in a
// batch, decoded one at a time, or decoded beside other sequences, and the differences grow
// through the layers and the sequence. Over about 1,200 answers of the short and long
// suites on stories260K, the flips had gaps from 0.00001 to 0.082 (docs/CHAOS.md); with
// eight sequences decoding at once (the overload scenario) one flip with a gap of 0.224
// recurred, in runs of the binary before and after the overload work alike. A real fault
// (a lost, repeated or garbled token) leaves a gap of a whole token's worth, typically
// well over 0.5.
const nearTie = 0.25

// maxNearTies bounds the share of compared answers that may differ from the reference at
// a proven near-tie (nearTie). On stories260K: 2-17% of 200-token answers differed at one
// in the short suite's first runs; with KV replicas on, one leave-join run had 26% (14 of
// 54, gaps at most 0.01: imports and evictions scatter a sequence's cells in the unified
// pool, and attention sums over them in another order). Idle histories moved to host
// memory and back (--kv-host) reshape the pool more: over the short-load scenarios
// (pause-resume, loss, delay, slow-link; two runs each, AMD EPYC, 2026-12-04) 30-37% with
// the moves, 17-31% without; one CI run failed at 20 of 54 under the earlier bound of
// 35%. Every one of them is proven a near-tie (gaps at most 0.023 seen); what the bound
// still catches is a change that makes most answers differ.
const maxNearTies = 0.5

// checkAnswers compares every completed answer, streamed or not, resumed or not, with the
// reference: what a quiet standalone node (same binary and model, one request at a time)
// answers to the same conversation and turn. Greedy decoding makes the two equal, except
// where the two most likely tokens are nearly tied: a difference is accepted only when
// the reference's own logprobs prove such a near-tie at the first differing token, and
// only up to maxNearTies of them.
func (c *Cluster) checkAnswers(ctx context.Context, rep *Report, cfg Config) {
	ref, stopRef, err := startReference(ctx, cfg)
	if err != nil {
		rep.Checks = append(rep.Checks, Check{Name: "every answer equals the reference", Detail: "reference node: " + err.Error()})
		return
	}
	defer stopRef()
	client := &http.Client{Timeout: time.Minute}
	var bad, ties []string
	resumed := 0
	for _, r := range rep.Records {
		if r.Kind != "ok" {
			continue
		}
		want, err := referenceAnswer(ctx, client, ref, r.Messages, r.MaxTokens)
		if err != nil {
			bad = append(bad, fmt.Sprintf("conv %d turn %d: the reference failed: %v", r.Conv, r.Turn, err))
			continue
		}
		rep.Compared++
		if r.Resumed {
			resumed++
		}
		if r.Text == want.text {
			continue
		}
		d := 0
		for d < min(len(r.Text), len(want.text)) && r.Text[d] == want.text[d] {
			d++
		}
		what := fmt.Sprintf("conv %d turn %d (stream %v, resumed at %v, via %s on %s): differs at byte %d of %d",
			r.Conv, r.Turn, r.Stream, r.Seams, r.Entry, r.Served, d, len(want.text))
		bound, near := nearTie, ""
		for _, seam := range r.Seams {
			if d >= seam && d <= seam+seamSlack {
				bound, near = seamTie, fmt.Sprintf(", %d bytes after the seam at %d where the answer moved", d-seam, seam)
			}
		}
		gap, proof := want.tieAt(r.Text, d, bound)
		what += near
		if proof == "" {
			ties = append(ties, fmt.Sprintf("%s: a near-tie (gap %.2g)", what, gap))
			continue
		}
		bad = append(bad, fmt.Sprintf("%s, not a near-tie (%s):\n  got       %q\n  reference %q", what, proof, around(r.Text, d), around(want.text, d)))
	}
	rep.NearTies = len(ties)
	maxTies := int(maxNearTies * float64(rep.Compared))
	rep.Checks = append(rep.Checks, Check{Name: "every answer equals the reference", Pass: len(bad) == 0 && rep.Compared > 0 && len(ties) <= maxTies,
		Detail: fmt.Sprintf("%d answers compared (%d resumed); %d differ at a proven near-tie (at most %d): %v; %d differ otherwise: %v",
			rep.Compared, resumed, len(ties), maxTies, firstN(ties, 3), len(bad), firstN(bad, 3))})
}

func around(s string, i int) string {
	return s[max(0, i-30):min(len(s), i+30)]
}

// Leak bounds: what a node may hold after the load beyond its own baseline. Goroutines:
// a few idle keep-alive connections more than at rest; heap: the engine's text buffers
// and caches are bounded far below this.
const (
	leakGoroutines = 16
	leakHeap       = 64 << 20
)

// seamSlack and seamTie: a difference in the first bytes after where a resumed answer moved
// owners may be lost or repeated text, so there it passes only as a closer near-tie.
// Lost text ("A B" sent, "A B C" given to the next owner) or repeated text ("A B C" sent,
// "A B" given) makes the answer take a token the reference did not nearly tie with: with
// the last token handed over lost (testbed/mutants/resume-token-lost.patch), the next
// owner repeated it, a token outside the reference's five likeliest. When the seam falls on
// a near-tie the gap can be small: a resume given three bytes too few (broken on purpose,
// when resumes went by text) was caught at gaps of 0.032, 0.33 and 0.69. A plain near-tie
// lands there too: the token after a seam comes from a fresh prefill of everything before
// it, where the reference decoded one token at a time.
// Seen 3 bytes after a seam in CI (pause-resume, 2026-12-06): a gap of 0.0066, which failed
// the bound of 0.005 set before; 0.02 sits 3x above it and 1.6x below the closest fault.
// Two long runs failed on near-ties 16 bytes after a seam (gap 0.0011, the same tie other
// answers of that conversation took with no seam) and 6 bytes before one (the bytes before
// a seam came from the first owner alone, so the move cannot explain them).
const (
	seamSlack = 16
	seamTie   = 0.02
)

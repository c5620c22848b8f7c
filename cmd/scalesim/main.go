// Command scalesim measures what grows with the cluster size, by simulation in one
// process: infernode's gossip (the real gossip package and memberlist, with infernode's
// settings, encryption and metadata) over an in-memory network of 100 to 1,000 members.
// It prints one markdown table row a size: time for a join storm to converge, time until
// every member learns of a crash, false removals under packet loss and under scheduling
// pauses, and gossip bytes a second a member, idle and with every member's load changing
// as fast as infernode gossips it.
//
//	go run ./cmd/scalesim -n 100,300,1000
//
// Ring costs are measured by `go test ./ring -bench Ring`; docs/SCALE.md has both.
package main

import (
	"context"
	"crypto/rand"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"runtime/debug"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/infernode/infernode/gossip"
	"github.com/infernode/infernode/internal/poll"
	"github.com/infernode/infernode/internal/simnet"
	"github.com/infernode/infernode/node/routing"
)

func main() {
	sizes := flag.String("n", "100,300,1000", "cluster sizes, comma-separated")
	window := flag.Duration("window", 20*time.Second, "how long each loss and pause phase runs")
	dilate := flag.Float64("dilate", 1, "run k times slower: every gossip interval and timeout, the phases and the ramp stretched k times, times reported divided by k and rates multiplied (members then get k times the CPU a simulated second)")
	ramp := flag.Float64("ramp", 0, "members a second starting after the seeds (0: all at once, a join storm)")
	wan := flag.Bool("wan", false, "simulate with the WAN settings docs/SCALE.md recommends")
	compress := flag.Bool("compress", false, "compress gossip as a real node does (LZW: too much CPU for 1,000 members on 2 cores; bytes are then smaller)")
	memProfile := flag.String("memprofile", "", "write a heap profile after 30 seconds here")
	cpuProfile := flag.String("cpuprofile", "", "write a CPU profile of the first 20 seconds here")
	flag.Parse()
	if *memProfile != "" {
		time.AfterFunc(30*time.Second, func() {
			f, err := os.Create(*memProfile)
			if err == nil {
				pprof.WriteHeapProfile(f) // best effort: a failed profile shows as an empty file
				f.Close()
			}
		})
	}
	// 1,000 members hold about 1.6 GB live (each keeps every other's state); the default
	// GOGC doubles that. A memory limit close to it would make the collector run without
	// pause and starve the members: keep it far above.
	debug.SetMemoryLimit(16 << 30)
	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err != nil {
			fmt.Fprintln(os.Stderr, "scalesim:", err)
			os.Exit(2)
		}
		pprof.StartCPUProfile(f) // best effort: a failed profile shows as an empty file
		time.AfterFunc(20*time.Second, pprof.StopCPUProfile)
	}
	fmt.Println("| members | settings | join storm converged | crash known to first / all | live members declared dead (by how many), 1% loss | 5% loss | pauses | bytes/s a member, idle | with load changes | CPU a member-second, idle | packets dropped at full inboxes |")
	fmt.Println("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
	for _, s := range strings.Split(*sizes, ",") {
		n, err := strconv.Atoi(s)
		if err != nil || n < 2 {
			fmt.Fprintf(os.Stderr, "scalesim: bad size %q\n", s)
			os.Exit(2)
		}
		if *dilate < 1 {
			fmt.Fprintln(os.Stderr, "scalesim: -dilate must be at least 1")
			os.Exit(2)
		}
		r, err := simulate(n, *window, *ramp, *dilate, *wan, *compress)
		if err != nil {
			fmt.Fprintf(os.Stderr, "scalesim: %d members: %v\n", n, err)
			os.Exit(1)
		}
		fmt.Println(r)
	}
}

// Settings are the gossip settings simulated.
func settings(wan bool) gossip.Config {
	if wan {
		return gossip.WANConfig()
	}
	return gossip.DefaultConfig()
}

// member is one simulated node and what it has seen.
type member struct {
	g  *gossip.Gossip
	t  *simnet.Transport
	id string

	mu    sync.Mutex
	state map[string]gossip.State // by member id
	alive int
}

type sim struct {
	n         int
	members   []*member
	crashed   sync.Map // id → true
	mu        sync.Mutex
	falseDead map[string]int // live members declared dead, by member: how many others did; guarded by mu
	converged atomic.Int64   // members that have seen all n alive
	deadSeen  atomic.Int64   // members that have seen the crashed one dead
	crashID   atomic.Value
}

// seen is the fewest and most members any member started so far sees alive.
func (s *sim) seen() (lo, hi int) {
	lo = s.n
	for _, m := range s.members {
		m.mu.Lock()
		lo, hi = min(lo, m.alive), max(hi, m.alive)
		m.mu.Unlock()
	}
	return lo, hi
}

// observe records one member's event about another.
func (s *sim) observe(m *member, ev gossip.Member) {
	id, _, _ := strings.Cut(ev.Name, "#")
	m.mu.Lock()
	defer m.mu.Unlock()
	prev := m.state[id]
	if prev == ev.State {
		return
	}
	m.state[id] = ev.State
	if prev == gossip.Alive {
		m.alive--
	}
	if ev.State == gossip.Alive {
		m.alive++
		if m.alive == s.n {
			s.converged.Add(1)
		}
	}
	if ev.State == gossip.Dead {
		_, down := s.crashed.Load(id)
		_, cutOff := s.crashed.Load(m.id) // a crashed member sees everyone die
		if !down && !cutOff {
			s.mu.Lock()
			s.falseDead[id]++
			s.mu.Unlock()
		} else if c, _ := s.crashID.Load().(string); c == id {
			s.deadSeen.Add(1)
		}
	}
}

func simulate(n int, window time.Duration, ramp, k float64, wan, compress bool) (string, error) {
	// d stretches a simulated duration to the real one; back brings a real one back.
	d := func(x time.Duration) time.Duration { return time.Duration(float64(x) * k) }
	back := func(x time.Duration) time.Duration { return time.Duration(float64(x) / k) }
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer func() {
		cancel()
		wg.Wait()
	}()
	key := make([]byte, 32)
	rand.Read(key)
	network := simnet.New()
	if wan {
		network.SetLatency(d(50*time.Millisecond), d(15*time.Millisecond)) // one way: round trips of about 100 ms
	}
	s := &sim{n: n, falseDead: map[string]int{}}
	s.crashID.Store("")
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	var seeds []string
	start := func(i int) (*member, error) {
		t := network.NewTransport()
		m := &member{t: t, id: fmt.Sprintf("node%04d", i), state: map[string]gossip.State{}}
		cfg := settings(wan)
		for _, x := range []*time.Duration{&cfg.ProbeInterval, &cfg.ProbeTimeout, &cfg.GossipInterval, &cfg.PushPullInterval,
			&cfg.MetaInterval, &cfg.RejoinInterval, &cfg.ForgetAfter} {
			*x = d(*x)
		}
		cfg.ID, cfg.Transport, cfg.Key, cfg.Logger, cfg.Schema = m.id, t, key, quiet, routing.Schema
		cfg.DisableCompression = !compress
		if i == 0 && os.Getenv("SCALESIM_LOG") != "" {
			cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
		}
		cfg.Observe = func(ev gossip.Member) { s.observe(m, ev) }
		cfg.Join = seeds
		g, err := gossip.New(cfg, meta(m.id, t.Addr(), 0))
		if err != nil {
			return nil, err
		}
		m.g = g
		wg.Go(func() { g.Run(ctx) }) // a failed start shows as a member that never converges
		return m, nil
	}
	// The seed members (5, or one in 20) form the cluster, then every other member starts
	// at once and joins through the seeds (each contacts three of them).
	nseeds := max(5, n/20)
	for i := range nseeds {
		m, err := start(i)
		if err != nil {
			return "", err
		}
		s.members = append(s.members, m)
		if i == 0 {
			seeds = []string{m.t.Addr()}
		}
	}
	if !poll.Within(d(2*time.Minute), every, func() bool { lo, _ := s.seen(); return lo >= nseeds }) {
		return "", errors.New("the seed members did not see each other within a minute")
	}
	seeds = nil
	for _, m := range s.members {
		seeds = append(seeds, m.t.Addr())
	}
	began := time.Now()
	for i := nseeds; i < n; i++ {
		if ramp > 0 {
			time.Sleep(d(time.Duration(float64(time.Second) / ramp))) // the pace of the ramp, not a synchronisation
		}
		m, err := start(i)
		if err != nil {
			return "", err
		}
		s.members = append(s.members, m)
	}
	next := began.Add(10 * time.Second)
	storm := "over 3 min"
	if poll.Within(d(3*time.Minute), every, func() bool {
		if time.Now().After(next) {
			next = next.Add(10 * time.Second)
			lo, hi := s.seen()
			progress(n, "join storm: %d members see all; each sees %d to %d alive", s.converged.Load(), lo, hi)
		}
		return s.converged.Load() >= int64(n)
	}) {
		storm = fmt.Sprintf("%.1f s", back(time.Since(began)).Seconds())
	} else {
		lo, _ := s.seen()
		storm += fmt.Sprintf(" (%d of %d see all; the fewest any sees: %d)", s.converged.Load(), n, lo)
	}
	progress(n, "join storm: %s", storm)

	// The storm's news is still being retransmitted; measure once it has died down (the
	// rate over 2 s stops falling), for at most 3 minutes.
	settled := time.Now()
	for prev, peak := 0.0, 0.0; time.Since(settled) < d(3*time.Minute); {
		cur := bandwidth(s, d(2*time.Second), d(500*time.Millisecond), nil)
		peak = max(peak, cur)
		if cur < peak/2 && cur > 0.9*prev {
			break
		}
		prev = cur
	}
	progress(n, "the join storm's gossip died down after %v more (simulated)", back(time.Since(settled)).Round(time.Second))
	cpu0 := cpuTime()
	idle := bandwidth(s, d(10*time.Second), d(500*time.Millisecond), nil) * k
	cpu := float64((cpuTime() - cpu0).Microseconds()) / 1000 / (d(10*time.Second).Seconds() / k) / float64(n)
	churn := k * bandwidth(s, d(10*time.Second), d(500*time.Millisecond), func(round int) {
		for i, m := range s.members {
			m.g.SetTags(meta(m.id, m.t.Addr(), round*7+i)) // cannot fail: the same fields as New accepted
		}
	})

	// A crash: the last member stops answering anything.
	victim := s.members[n-1]
	s.crashed.Store(victim.id, true)
	s.crashID.Store(victim.id)
	crashed := time.Now()
	victim.t.Crash()
	var firstKnown time.Duration
	known := "over 2 min"
	if poll.Within(d(2*time.Minute), every, func() bool {
		if firstKnown == 0 && s.deadSeen.Load() > 0 {
			firstKnown = time.Since(crashed)
		}
		return s.deadSeen.Load() >= int64(n-1)
	}) {
		known = fmt.Sprintf("%.1f s", back(time.Since(crashed)).Seconds())
	} else {
		known += fmt.Sprintf(" (%d of %d)", s.deadSeen.Load(), n-1)
	}
	var dropped int64
	for _, m := range s.members {
		dropped += m.t.Overflowed()
	}
	progress(n, "idle: %.2f ms of CPU a member-second", cpu)
	progress(n, "bytes/s a member %.0f idle, %.0f with load changes; crash known to all in %s; packets dropped at full inboxes so far: %d",
		idle, churn, known, dropped)

	// falseUnder counts the live members declared dead during a phase, and by how many
	// members in all.
	falseUnder := func(setup func(), teardown func()) string {
		s.mu.Lock()
		clear(s.falseDead)
		s.mu.Unlock()
		setup()
		time.Sleep(d(window)) // the phase's length is what is measured over, not a synchronisation
		teardown()
		s.mu.Lock()
		defer s.mu.Unlock()
		events := 0
		for _, c := range s.falseDead {
			events += c
		}
		if events == 0 {
			return "0"
		}
		return fmt.Sprintf("%d (by %d)", len(s.falseDead), events)
	}
	loss1 := falseUnder(func() { network.SetLoss(0.01) }, func() { network.SetLoss(0) })
	loss5 := falseUnder(func() { network.SetLoss(0.05) }, func() { network.SetLoss(0) })
	// Pauses: every 2 s, 3 members are descheduled for 1 s.
	stop := make(chan struct{})
	paused := falseUnder(func() {
		wg.Go(func() {
			tick := time.NewTicker(d(2 * time.Second))
			defer tick.Stop()
			for round := 0; ; round++ {
				for j := range 3 {
					s.members[(round*3+j)%(n-1)].t.Pause(d(time.Second))
				}
				select {
				case <-stop:
					return
				case <-tick.C:
				}
			}
		})
	}, func() { close(stop) })
	name := "LAN"
	if wan {
		name = "WAN"
	}
	dropped = 0
	for _, m := range s.members {
		dropped += m.t.Overflowed()
	}
	if ramp > 0 {
		name += fmt.Sprintf(", %g joins/s", ramp)
	}
	return fmt.Sprintf("| %d | %s | %s | %.1f / %s | %s | %s | %s | %s | %s | %.2f ms | %d |", n, name, storm,
		back(firstKnown).Seconds(), known, loss1, loss5, paused, bytesPerSec(idle), bytesPerSec(churn), cpu, dropped), nil
}

// every is how often the simulation checks what it waits for.
const every = 50 * time.Millisecond

// progress tells stderr how far a simulation is.
func progress(n int, format string, args ...any) {
	fmt.Fprintf(os.Stderr, "%s %d members: %s\n", time.Now().Format("15:04:05"), n, fmt.Sprintf(format, args...))
}

// cpuTime is the CPU this process has used, user and system.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// meta is the metadata a ready infernode node gossips (routing's), with load as set by
// round.
func meta(id, addr string, round int) []byte {
	host, _, _ := strings.Cut(addr, ":")
	b, err := routing.Meta{ID: id, HTTPAddr: host + ":8080", Fingerprint: "6f1c2a9e4b7d3c10", Ready: true, Hop: []int{1},
		Running: round % 8, Waiting: round % 5, FreeKV: 65536 - round%4096, QueueCap: 64, Prefill: 240 + round%30}.Encode()
	if err != nil {
		panic(err) // short ids and addresses: far within the limit
	}
	return b
}

// bandwidth is the mean bytes a second each member sent over d, with change (if set)
// called every interval (infernode's metadata interval, 500 ms, as simulated).
func bandwidth(s *sim, d, every time.Duration, change func(round int)) float64 {
	sent := func() (total int64) {
		for _, m := range s.members {
			total += m.t.Sent()
		}
		return total
	}
	before, began := sent(), time.Now()
	tick := time.NewTicker(every)
	defer tick.Stop()
	for round := 1; time.Since(began) < d; round++ {
		if change != nil {
			change(round)
		}
		<-tick.C
	}
	return float64(sent()-before) / time.Since(began).Seconds() / float64(len(s.members))
}

func bytesPerSec(b float64) string {
	if b >= 1024 {
		return fmt.Sprintf("%.1f KiB", b/1024)
	}
	return fmt.Sprintf("%.0f B", b)
}

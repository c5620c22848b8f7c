package netem

import (
	"container/heap"
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"time"

	nfqueue "github.com/florianl/go-nfqueue/v2"
	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// Shape is a delay to add to packets, drawn per packet like tc netem draws it: Delay plus
// Jitter times a random deviate of the distribution (normal, or pareto-normal: heavier on
// the slow side), never below zero. Packets whose delays cross are reordered, as with tc
// netem.
type Shape struct {
	Delay, Jitter time.Duration
	// Dist is "normal" (the default) or "paretonormal".
	Dist string
}

func (s Shape) String() string {
	return fmt.Sprintf("%v ± %v %s", s.Delay, s.Jitter, s.Dist)
}

func (s Shape) validate() error {
	switch {
	case s.Delay < 0 || s.Jitter < 0:
		return fmt.Errorf("netem: delay and jitter must not be negative, got %v", s)
	case s.Dist != "" && s.Dist != "normal" && s.Dist != "paretonormal":
		return fmt.Errorf("netem: distribution %q is not normal or paretonormal", s.Dist)
	}
	return nil
}

// sample draws one packet's delay.
func (s Shape) sample(r *rand.Rand) time.Duration {
	var z float64
	switch s.Dist {
	case "paretonormal":
		z = paretoNormal(r)
	default:
		z = r.NormFloat64()
	}
	return max(0, s.Delay+time.Duration(z*float64(s.Jitter)))
}

// paretoNormal is iproute2's pareto-normal deviate (three quarters normal, one quarter
// pareto with shape 3, as its paretonormal table mixes them), scaled here to a standard
// deviation of 1 so that Jitter means the same for both distributions.
func paretoNormal(r *rand.Rand) float64 {
	const alpha = 3.0
	// A pareto deviate with xm = 1 has mean 1.5 and standard deviation sqrt(3)/2.
	p := (math.Pow(1-r.Float64(), -1/alpha) - 1.5) / (math.Sqrt(3) / 2)
	return (0.75*r.NormFloat64() + 0.25*p) / math.Sqrt(0.75*0.75+0.25*0.25)
}

// Delay adds latency with jitter to what the host sends: to the hosts given, or to every
// other host when none are (never to the driver on the bridge). It uses the kernel's
// sch_netem where there is one and the delay is for every host, and otherwise holds the
// packets in userspace: an iptables NFQUEUE rule hands them to this process, which
// releases each after its delay. It reports the backend it used ("netem" or "nfqueue").
// The userspace queue lives in this process: it ends with Heal, Close or the process.
func (h *Host) Delay(s Shape, to ...*Host) (backend string, err error) {
	if err := s.validate(); err != nil {
		return "", err
	}
	if len(to) == 0 && s.Dist != "paretonormal" {
		err := run("ip", "netns", "exec", h.NS, "tc", "qdisc", "replace", "dev", "eth0", "root", "netem",
			"delay", fmt.Sprintf("%dus", s.Delay.Microseconds()), fmt.Sprintf("%dus", s.Jitter.Microseconds()),
			"distribution", "normal")
		if err == nil {
			return "netem", nil
		}
	}
	return "nfqueue", h.queueDelay(s, to)
}

// The userspace delay: one NFQUEUE queue per rule, each with a consumer that holds the
// packets (by id; the kernel keeps them) and gives each its verdict when its delay ends.

// maxHeld bounds the packets one queue holds; past it the kernel lets packets through
// undelayed (fail-open) rather than drop them.
const maxHeld = 1 << 16

type delayer struct {
	nf     *nfqueue.Nfqueue
	shape  Shape
	cancel context.CancelFunc
	done   chan struct{}
	alarm  *alarm

	mu   sync.Mutex // also orders the alarm's settings
	rng  *rand.Rand
	held releases
}

type release struct {
	at time.Time
	id uint32
}

// releases is a min-heap by release time.
type releases []release

func (r releases) Len() int           { return len(r) }
func (r releases) Less(i, j int) bool { return r[i].at.Before(r[j].at) }
func (r releases) Swap(i, j int)      { r[i], r[j] = r[j], r[i] }
func (r *releases) Push(x any)        { *r = append(*r, x.(release)) }
func (r *releases) Pop() any {
	old := *r
	x := old[len(old)-1]
	*r = old[:len(old)-1]
	return x
}

func (h *Host) queueDelay(s Shape, to []*Host) error {
	dests := []string{h.t.Subnet}
	if len(to) > 0 {
		dests = dests[:0]
		for _, o := range to {
			dests = append(dests, o.IP)
		}
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	num := uint16(len(h.delayers) + 1)
	d, err := openDelayer(h.NS, num, s)
	if err != nil {
		return err
	}
	// iptables-legacy: the xtables NFQUEUE target, which kernels without nftables' queue
	// expression still have. What goes to the driver on the bridge is never delayed.
	rules := [][]string{{"-d", h.t.DriverIP, "-j", "ACCEPT"}}
	if len(h.delayers) > 0 {
		rules = nil // there already
	}
	for _, dst := range dests {
		rules = append(rules, []string{"-d", dst, "-j", "NFQUEUE", "--queue-num", fmt.Sprint(num), "--queue-bypass"})
	}
	for _, rule := range rules {
		err := run(append([]string{"ip", "netns", "exec", h.NS, "iptables-legacy", "-A", "OUTPUT"}, rule...)...)
		if err != nil {
			d.close()
			run("ip", "netns", "exec", h.NS, "iptables-legacy", "-F", "OUTPUT")
			return fmt.Errorf("%w: userspace delay needs iptables' NFQUEUE target (%v)", ErrUnsupported, err)
		}
	}
	h.delayers = append(h.delayers, d)
	return nil
}

func openDelayer(ns string, num uint16, s Shape) (*delayer, error) {
	f, err := os.Open(filepath.Join("/var/run/netns", ns))
	if err != nil {
		return nil, fmt.Errorf("netem: namespace %s: %w", ns, err)
	}
	defer f.Close()
	nf, err := nfqueue.Open(&nfqueue.Config{
		NetNS: int(f.Fd()), NfQueue: num, MaxQueueLen: maxHeld, Copymode: nfqueue.NfQnlCopyMeta,
		Flags: nfqueue.NfQaCfgFlagFailOpen | nfqueue.NfQaCfgFlagGSO, WriteTimeout: time.Second,
	})
	if err != nil {
		return nil, fmt.Errorf("%w: cannot open an NFQUEUE in %s: %v", ErrUnsupported, ns, err)
	}
	if err := nf.SetOption(netlink.NoENOBUFS, true); err != nil {
		nf.Close()
		return nil, fmt.Errorf("netem: nfqueue option: %w", err)
	}
	al, err := newAlarm()
	if err != nil {
		nf.Close()
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	d := &delayer{nf: nf, shape: s, cancel: cancel, done: make(chan struct{}), alarm: al,
		rng: rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64()))}
	err = nf.RegisterWithErrorFunc(ctx, d.take, func(err error) int {
		if ctx.Err() != nil {
			return 1
		}
		return 0 // a read error (a full socket buffer): the queue fails open meanwhile
	})
	if err != nil {
		cancel()
		nf.Close()
		al.close()
		return nil, fmt.Errorf("%w: cannot register on NFQUEUE %d in %s: %v", ErrUnsupported, num, ns, err)
	}
	go d.releaseLoop(ctx)
	return d, nil
}

// take holds one packet until its delay has passed.
func (d *delayer) take(a nfqueue.Attribute) int {
	if a.PacketID == nil {
		return 0
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	wait := d.shape.sample(d.rng)
	heap.Push(&d.held, release{at: time.Now().Add(wait), id: *a.PacketID})
	if d.held[0].id == *a.PacketID {
		d.alarm.set(wait)
	}
	return 0
}

// releaseLoop lets each held packet go when its time comes; when ctx ends it lets every
// packet still held go at once.
func (d *delayer) releaseLoop(ctx context.Context) {
	defer close(d.done)
	for {
		now := time.Now()
		var due []uint32
		d.mu.Lock()
		for len(d.held) > 0 && (!d.held[0].at.After(now) || ctx.Err() != nil) {
			due = append(due, heap.Pop(&d.held).(release).id)
		}
		if len(d.held) > 0 {
			d.alarm.set(d.held[0].at.Sub(now))
		}
		d.mu.Unlock()
		for _, id := range due {
			d.nf.SetVerdict(id, nfqueue.NfAccept) // a packet the kernel gave up on is simply gone
		}
		if ctx.Err() != nil {
			return
		}
		d.alarm.wait()
	}
}

// close lets every held packet go and closes the queue.
func (d *delayer) close() {
	d.cancel()
	d.mu.Lock()
	d.alarm.set(0)
	d.mu.Unlock()
	<-d.done
	d.nf.Close()
	d.alarm.close()
}

// alarm wakes a goroutine at a set time, as precisely as the kernel's timers: a timerfd
// read through the runtime's poller. Go's timers sleep in epoll_wait, whose timeout is in
// whole milliseconds, so they fire up to a millisecond late; with them a 5 ms delay added
// 5.7-5.9 ms.
type alarm struct {
	f  *os.File
	fd int
}

func newAlarm() (*alarm, error) {
	fd, err := unix.TimerfdCreate(unix.CLOCK_MONOTONIC, unix.TFD_NONBLOCK|unix.TFD_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("netem: timerfd: %w", err)
	}
	return &alarm{f: os.NewFile(uintptr(fd), "timerfd"), fd: fd}, nil
}

// set makes the alarm go off after d, replacing any earlier setting; at once when d <= 0.
func (a *alarm) set(d time.Duration) {
	spec := unix.ItimerSpec{Value: unix.NsecToTimespec(max(int64(d), 1))} // zero would disarm it
	unix.TimerfdSettime(a.fd, 0, &spec, nil)                              // fails only once closed
}

// wait blocks until the alarm goes off (at once if it went off since it was last set).
func (a *alarm) wait() {
	var n [8]byte
	a.f.Read(n[:])
}

func (a *alarm) close() { a.f.Close() }

// healDelays removes the host's userspace delays: first the rules, so no packet is
// queued any more, then the queues, which let what they hold go.
func (h *Host) healDelays() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	var err error
	if len(h.delayers) > 0 {
		err = run("ip", "netns", "exec", h.NS, "iptables-legacy", "-F", "OUTPUT")
	}
	for _, d := range h.delayers {
		d.close()
	}
	h.delayers = nil
	return err
}

// Package simnet is an in-memory network for memberlist: many gossip members in one
// process, with packet latency and loss, crashed members and paused members, and a count of the bytes
// each member sends. memberlist's own MockNetwork delivers packets synchronously and
// cannot lose or hold them; this one behaves like UDP (a full inbox drops) and TCP (a
// stream is a net.Pipe).
package simnet

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/memberlist"
)

// inbox is how many packets wait for a member before more are dropped: about Linux's
// default UDP receive buffer (208 KiB) of full-sized gossip packets.
const inbox = 160

// Network connects Transports. Sending a packet takes no lock: a thousand members send
// thousands a second.
type Network struct {
	nodes sync.Map      // address → *Transport
	next  atomic.Int64  // addresses handed out
	loss  atomic.Uint64 // probability a packet is dropped, as float64 bits
	delay atomic.Int64  // one-way packet latency, mean, in nanoseconds
	sigma atomic.Int64  // and its standard deviation
}

// New makes an empty network.
func New() *Network { return &Network{} }

// SetLoss drops each packet (not stream) with probability p from now on.
func (n *Network) SetLoss(p float64) { n.loss.Store(math.Float64bits(p)) }

// SetLatency delays each packet (not stream) by a normal draw of mean d and standard
// deviation sigma (never below zero) from now on.
func (n *Network) SetLatency(d, sigma time.Duration) {
	n.delay.Store(int64(d))
	n.sigma.Store(int64(sigma))
}

// NewTransport makes a member's transport at a fresh address (10.x.y.z:7946).
func (n *Network) NewTransport() *Transport {
	i := n.next.Add(1)
	ip := net.IPv4(10, byte(i>>16), byte(i>>8), byte(i))
	t := &Transport{net: n, ip: ip, addr: net.JoinHostPort(ip.String(), "7946"),
		packets: make(chan *memberlist.Packet, inbox), streams: make(chan net.Conn), done: make(chan struct{})}
	n.nodes.Store(t.addr, t)
	return t
}

// lookup is the transport at addr, whether a packet to it is lost, and its latency.
func (n *Network) lookup(addr string) (to *Transport, lost bool, latency time.Duration) {
	if v, ok := n.nodes.Load(addr); ok {
		to = v.(*Transport)
	}
	if p := math.Float64frombits(n.loss.Load()); p > 0 {
		lost = rand.Float64() < p
	}
	if d := n.delay.Load(); d > 0 {
		latency = max(0, time.Duration(float64(d)+rand.NormFloat64()*float64(n.sigma.Load())))
	}
	return to, lost, latency
}

// Transport is one member's end of the network. It implements
// memberlist.NodeAwareTransport.
type Transport struct {
	net     *Network
	ip      net.IP
	addr    string
	packets chan *memberlist.Packet
	streams chan net.Conn
	done    chan struct{}
	once    sync.Once

	sent    atomic.Int64 // bytes written, packets and streams
	dropped atomic.Int64 // packets to this member dropped because its inbox was full
	crashed atomic.Bool
	resume  atomic.Int64 // unix nanoseconds until which the member is paused
}

var _ memberlist.NodeAwareTransport = (*Transport)(nil)

// Addr is the member's address (host:port).
func (t *Transport) Addr() string { return t.addr }

// Sent is how many bytes the member has sent.
func (t *Transport) Sent() int64 { return t.sent.Load() }

// Overflowed is how many packets to the member were dropped because it did not read
// them fast enough (in a simulation: the process had too little CPU for its members).
func (t *Transport) Overflowed() int64 { return t.dropped.Load() }

// Crash cuts the member off as a crash would: nothing reaches it or leaves it.
func (t *Transport) Crash() { t.crashed.Store(true) }

// Pause holds every packet to and from the member for d, as a process descheduled for d
// would see the network: what was sent to it arrives when it runs again, and what it
// sends leaves then.
func (t *Transport) Pause(d time.Duration) { t.resume.Store(time.Now().Add(d).UnixNano()) }

// held is how long a packet through t must wait for its pause to end.
func (t *Transport) held(now time.Time) time.Duration {
	return max(0, time.Duration(t.resume.Load()-now.UnixNano()))
}

// FinalAdvertiseAddr implements memberlist.Transport.
func (t *Transport) FinalAdvertiseAddr(string, int) (net.IP, int, error) { return t.ip, 7946, nil }

// WriteTo implements memberlist.Transport.
func (t *Transport) WriteTo(b []byte, addr string) (time.Time, error) {
	return t.WriteToAddress(b, memberlist.Address{Addr: addr})
}

// WriteToAddress implements memberlist.NodeAwareTransport: the packet is delivered
// unless it is lost, either end crashed, or the receiver's inbox is full.
func (t *Transport) WriteToAddress(b []byte, a memberlist.Address) (time.Time, error) {
	now := time.Now()
	t.sent.Add(int64(len(b)))
	to, lost, latency := t.net.lookup(a.Addr)
	if to == nil || lost || t.crashed.Load() || to.crashed.Load() {
		return now, nil
	}
	p := &memberlist.Packet{Buf: append([]byte(nil), b...), From: &net.UDPAddr{IP: t.ip, Port: 7946}}
	deliver := func() {
		p.Timestamp = time.Now()
		select {
		case to.packets <- p:
		case <-to.done:
		default: // a full socket buffer drops
			to.dropped.Add(1)
		}
	}
	if wait := max(t.held(now), to.held(now)) + latency; wait > 0 {
		time.AfterFunc(wait, deliver)
	} else {
		deliver()
	}
	return now, nil
}

// PacketCh implements memberlist.Transport.
func (t *Transport) PacketCh() <-chan *memberlist.Packet { return t.packets }

// DialTimeout implements memberlist.Transport.
func (t *Transport) DialTimeout(addr string, timeout time.Duration) (net.Conn, error) {
	return t.DialAddressTimeout(memberlist.Address{Addr: addr}, timeout)
}

// DialAddressTimeout implements memberlist.NodeAwareTransport with a net.Pipe.
func (t *Transport) DialAddressTimeout(a memberlist.Address, timeout time.Duration) (net.Conn, error) {
	to, _, _ := t.net.lookup(a.Addr)
	if to == nil || t.crashed.Load() || to.crashed.Load() {
		return nil, fmt.Errorf("dial %s: %w", a.Addr, errUnreachable)
	}
	mine, theirs := net.Pipe()
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	select {
	case to.streams <- counted{theirs, &to.sent}:
		return counted{mine, &t.sent}, nil
	case <-to.done:
	case <-timer.C:
	}
	mine.Close()
	theirs.Close()
	return nil, fmt.Errorf("dial %s: %w", a.Addr, errUnreachable)
}

var errUnreachable = errors.New("unreachable")

// StreamCh implements memberlist.Transport.
func (t *Transport) StreamCh() <-chan net.Conn { return t.streams }

// Shutdown implements memberlist.Transport.
func (t *Transport) Shutdown() error {
	t.once.Do(func() { close(t.done) })
	return nil
}

// counted counts the bytes written through a stream.
type counted struct {
	net.Conn
	n *atomic.Int64
}

func (c counted) Write(b []byte) (int, error) {
	n, err := c.Conn.Write(b)
	c.n.Add(int64(n))
	return n, err
}

package node

import (
	"errors"
	"net"
	"net/netip"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// fasthttp runs a handler on the connection's own goroutine and never looks at the socket
// until the response is written, so it cannot tell a handler that the client went away.
// watchConn does: it peeks at the socket (MSG_PEEK, so it consumes nothing) and reports a
// close. A client that pipelines another request is not mistaken for gone: its bytes are
// still there for fasthttp to read.

// connPollInterval is how often a waiting request checks its client.
const connPollInterval = 50 * time.Millisecond

// watchConn calls gone once if conn is closed by its peer, until stop is called. stop
// waits for the watcher to exit. Connections without a socket (in-memory ones in tests)
// are not watched.
func watchConn(conn net.Conn, gone func()) (stop func()) {
	sc, ok := conn.(syscall.Conn)
	if !ok {
		return func() {}
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return func() {}
	}
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		t := time.NewTicker(connPollInterval)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
			}
			if peerClosed(raw) {
				gone()
				return
			}
		}
	})
	var once sync.Once
	return func() {
		once.Do(func() { close(done) })
		wg.Wait()
	}
}

// peerClosed reports whether the peer has closed or reset the connection. It peeks with
// Control, not Read: Read fails once the connection's read deadline has passed, and
// fasthttp leaves the request's read deadline set while the handler runs, so every
// answer outliving the read timeout looked like a client gone.
func peerClosed(raw syscall.RawConn) bool {
	var closed bool
	var buf [1]byte
	err := raw.Control(func(fd uintptr) {
		n, _, err := unix.Recvfrom(int(fd), buf[:], unix.MSG_PEEK|unix.MSG_DONTWAIT)
		switch {
		case n == 0 && err == nil:
			closed = true // orderly shutdown: EOF
		case err != nil && !errors.Is(err, unix.EAGAIN):
			closed = true // reset or another socket error
		}
	})
	return closed || err != nil
}

// capListener caps the connections open at once from one IP address, for a node exposed
// to clients directly (behind a load balancer every client shares its address, so the cap
// is off by default). Members of the cluster are exempt: a peer forwards many clients'
// requests. A connection over the cap is answered 429 and closed before fasthttp reads it.
type capListener struct {
	net.Listener
	max     int
	peer    func(netip.Addr) bool
	refused func()

	mu   sync.Mutex
	open map[netip.Addr]int
}

func capPerIP(ln net.Listener, max int, peer func(netip.Addr) bool, refused func()) net.Listener {
	return &capListener{Listener: ln, max: max, peer: peer, refused: refused, open: map[netip.Addr]int{}}
}

// tooMany is written to a connection over the cap: a complete HTTP answer, so a client
// sees why, not only a reset.
const tooMany = "HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: 118\r\n\r\n" +
	`{"error":{"message":"too many connections from this address","type":"rate_limit_error","code":"too_many_connections"}}`

func (l *capListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		ap, err := netip.ParseAddrPort(c.RemoteAddr().String())
		if err != nil {
			return c, nil // not an IP connection (in-memory, in tests): nothing to count
		}
		ip := ap.Addr().Unmap()
		l.mu.Lock()
		over := l.open[ip] >= l.max
		if !over {
			l.open[ip]++
		}
		l.mu.Unlock()
		if over && !l.peer(ip) {
			l.refused()
			c.SetWriteDeadline(time.Now().Add(time.Second))
			c.Write([]byte(tooMany))
			c.Close()
			continue
		}
		if over { // a peer: served, not counted
			return c, nil
		}
		return &countedConn{Conn: c, done: func() {
			l.mu.Lock()
			defer l.mu.Unlock()
			if l.open[ip]--; l.open[ip] == 0 {
				delete(l.open, ip)
			}
		}}, nil
	}
}

// countedConn calls done once, when closed.
type countedConn struct {
	net.Conn
	once sync.Once
	done func()
}

func (c *countedConn) Close() error {
	c.once.Do(c.done)
	return c.Conn.Close()
}

// SyscallConn is the socket's, so watchConn can still peek at it.
func (c *countedConn) SyscallConn() (syscall.RawConn, error) {
	if sc, ok := c.Conn.(syscall.Conn); ok {
		return sc.SyscallConn()
	}
	return nil, errors.ErrUnsupported
}

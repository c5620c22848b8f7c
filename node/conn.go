package node

import (
	"errors"
	"net"
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

// peerClosed reports whether the peer has closed or reset the connection.
func peerClosed(raw syscall.RawConn) bool {
	var closed bool
	var buf [1]byte
	err := raw.Read(func(fd uintptr) bool {
		n, _, err := unix.Recvfrom(int(fd), buf[:], unix.MSG_PEEK|unix.MSG_DONTWAIT)
		switch {
		case n == 0 && err == nil:
			closed = true // orderly shutdown: EOF
		case err != nil && !errors.Is(err, unix.EAGAIN):
			closed = true // reset or another socket error
		}
		return true // never wait for readiness
	})
	return closed || err != nil
}

package measure

import (
	"io"
	"math"
	"net"
	"time"
)

// The floors of a KV transfer, measured on this machine in the run that compares against
// them: the hop signs a frame's hash and the receiver checks it, and the bytes cross a
// connection.

// HashTime is the best of three times to hash n bytes with sum here.
func HashTime(n int, sum func([]byte)) time.Duration {
	buf := make([]byte, n)
	best := time.Duration(math.MaxInt64)
	for range 3 {
		start := time.Now()
		sum(buf)
		best = min(best, time.Since(start))
	}
	return best
}

// LoopbackTime is the best of three times to send n bytes over a TCP connection on
// loopback, from memory to memory (both buffers touched before).
func LoopbackTime(n int) (time.Duration, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	src, dst := make([]byte, n), make([]byte, n)
	best := time.Duration(math.MaxInt64)
	for range 3 {
		done := make(chan error, 1)
		go func() {
			c, err := ln.Accept()
			if err == nil {
				_, err = io.ReadFull(c, dst)
				c.Close()
			}
			done <- err
		}()
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			return 0, err
		}
		start := time.Now()
		_, err = c.Write(src)
		if err == nil {
			err = <-done
		}
		c.Close()
		if err != nil {
			return 0, err
		}
		best = min(best, time.Since(start))
	}
	return best, nil
}

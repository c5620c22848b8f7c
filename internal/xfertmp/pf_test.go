package xfer

import (
	"testing"
	"time"
	"runtime"
)

var sink []byte

func TestPF(t *testing.T) {
	for i := 0; i < 5; i++ {
		start := time.Now()
		b := make([]byte, 32<<20)
		for j := 0; j < len(b); j += 4096 {
			b[j] = 1
		}
		sink = b
		t.Logf("alloc+touch 32MB: %v", time.Since(start))
		sink = nil
		runtime.GC(); runtime.GC()
	}
}

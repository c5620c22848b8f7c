package keep

import "testing"

// TestBuffers: a buffer put back is the next one got, with its memory; no more than n are
// kept, and none larger than max.
func TestBuffers(t *testing.T) {
	b := New(1, 1<<10)
	p := b.Get()
	*p = make([]byte, 0, 512)
	b.Put(p)
	b.Put(&[]byte{}) // one is kept already
	if q := b.Get(); q != p || cap(*q) != 512 {
		t.Errorf("got %p (cap %d), want the buffer put back", q, cap(*q))
	}
	if q := b.Get(); cap(*q) != 0 {
		t.Errorf("a second buffer was kept (cap %d)", cap(*q))
	}
	big := make([]byte, 0, 2<<10)
	b.Put(&big)
	if q := b.Get(); q == &big {
		t.Error("a buffer larger than max was kept")
	}
}

// TestSized: a buffer grown for a frame is twice its length (up to the largest kept), so
// that the next turns' frames, a little longer each, land in the same memory.
func TestSized(t *testing.T) {
	b := New(1, 3000)
	var p []byte
	first := b.Sized(&p, 1000)
	if len(first) != 1000 || cap(p) != 2000 {
		t.Fatalf("len %d, cap %d: want 1000 and 2000", len(first), cap(p))
	}
	for n := 1100; n <= 2000; n += 100 {
		if got := b.Sized(&p, n); len(got) != n || &got[0] != &first[0] {
			t.Fatalf("%d bytes: new memory (or len %d), want the same buffer", n, len(got))
		}
	}
	if got := b.Sized(&p, 2001); &got[0] == &first[0] || cap(got) != 3000 {
		t.Errorf("past its capacity: the same buffer, or capacity %d (want the largest kept, 3000)", cap(got))
	}
	if got := b.Sized(&p, 4000); cap(got) != 4000 {
		t.Errorf("past the largest kept: capacity %d, want 4000", cap(got))
	}
}

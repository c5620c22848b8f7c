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

// TestSized: a buffer grown for a frame keeps a quarter to spare, so that the next turns'
// frames, a little longer each, land in the same memory.
func TestSized(t *testing.T) {
	var p []byte
	first := Sized(&p, 1000)
	if len(first) != 1000 || cap(p) != 1250 {
		t.Fatalf("len %d, cap %d: want 1000 and 1250", len(first), cap(p))
	}
	for n := 1020; n <= 1250; n += 20 {
		if b := Sized(&p, n); len(b) != n || &b[0] != &first[0] {
			t.Fatalf("%d bytes: new memory (or len %d), want the same buffer", n, len(b))
		}
	}
	if b := Sized(&p, 1251); &b[0] == &first[0] || len(b) != 1251 {
		t.Error("past its capacity: the same buffer")
	}
}

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

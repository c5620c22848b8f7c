// Package keep keeps a few large byte buffers between uses. On the machines this project
// is measured on, memory touched for the first time costs about 11µs a page (session's
// BenchmarkFirstTouch): a fresh buffer for a KV frame of tens of megabytes costs more than
// the frame's copy, hash and import. A sync.Pool would not do: every garbage collection
// empties it.
package keep

// Buffers is a free list of at most n buffers, each kept only up to max bytes. Safe for
// concurrent use.
type Buffers struct {
	free chan *[]byte
	max  int
}

// New keeps up to n buffers of at most max bytes.
func New(n, max int) *Buffers { return &Buffers{free: make(chan *[]byte, n), max: max} }

// Get returns a kept buffer, or a new empty one.
func (b *Buffers) Get() *[]byte {
	select {
	case p := <-b.free:
		return p
	default:
		return new([]byte)
	}
}

// Put keeps p for a later Get, unless it is larger than max or n are kept already.
func (b *Buffers) Put(p *[]byte) {
	if cap(*p) > b.max {
		return
	}
	select {
	case b.free <- p:
	default:
	}
}

// Sized returns *p (a buffer got from b) resliced to n bytes, and keeps it in *p. A shorter
// buffer is replaced by one of twice n, up to the largest kept: a conversation's frame
// grows with every turn, and a buffer grown to each new length would be fresh memory
// every time. (Its pages past the longest frame read into it are never touched.)
func (b *Buffers) Sized(p *[]byte, n int) []byte {
	if cap(*p) < n {
		*p = make([]byte, n, max(n, min(2*n, b.max)))
	}
	*p = (*p)[:n]
	return *p
}

//go:build !linux

package keep

// Fresh returns an empty new buffer with room for n bytes.
func Fresh(n int) []byte { return make([]byte, 0, n) }

package session

import (
	"bytes"
	"strings"
	"unicode/utf8"
)

// textFilter turns token pieces into text a client may see. It holds back the bytes of a
// UTF-8 character split across pieces until the character is complete, and any text that
// may be the start of a stop string until it is known not to be one.
type textFilter struct {
	stops [][]byte
	held  []byte
}

func newTextFilter(stops []string) *textFilter {
	f := &textFilter{}
	for _, s := range stops {
		f.stops = append(f.stops, []byte(s))
	}
	return f
}

// push adds a token's piece. It returns the text that is now safe to emit and whether a
// stop string was found; after a stop, the text before it has been returned and the rest
// is dropped.
func (f *textFilter) push(piece []byte) (text string, stopped bool) {
	f.held = append(f.held, piece...)
	if i := f.firstStop(); i >= 0 {
		text = validText(f.held[:i])
		f.held = f.held[:0]
		return text, true
	}
	n := completeUTF8(f.held)
	n -= f.stopPrefixLen(f.held[:n])
	text = validText(f.held[:n])
	f.held = append(f.held[:0], f.held[n:]...)
	return text, false
}

// pending is how many bytes of the pieces pushed it holds back.
func (f *textFilter) pending() int { return len(f.held) }

// flush returns what is still held, at the end of generation (stop strings can no
// longer complete; an incomplete character is replaced by U+FFFD).
func (f *textFilter) flush() string {
	text := validText(f.held)
	f.held = f.held[:0]
	return text
}

// firstStop is the offset of the earliest stop string in held, or -1.
func (f *textFilter) firstStop() int {
	first := -1
	for _, s := range f.stops {
		if i := bytes.Index(f.held, s); i >= 0 && (first < 0 || i < first) {
			first = i
		}
	}
	return first
}

// stopPrefixLen is the length of the longest suffix of b that is a proper prefix of a stop
// string: text that must wait for the next piece.
func (f *textFilter) stopPrefixLen(b []byte) int {
	longest := 0
	for _, s := range f.stops {
		for n := min(len(s)-1, len(b)); n > longest; n-- {
			if bytes.HasSuffix(b, s[:n]) {
				longest = n
				break
			}
		}
	}
	return longest
}

// completeUTF8 is the length of the longest prefix of b that does not end inside a UTF-8
// character that more bytes could complete.
func completeUTF8(b []byte) int {
	// A character is at most 4 bytes: look back for the start of the last one.
	for i := len(b) - 1; i >= 0 && i >= len(b)-utf8.UTFMax; i-- {
		if utf8.RuneStart(b[i]) {
			if !utf8.FullRune(b[i:]) {
				return i
			}
			break
		}
	}
	return len(b)
}

func validText(b []byte) string { return strings.ToValidUTF8(string(b), "\uFFFD") }

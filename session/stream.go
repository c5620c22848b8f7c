package session

import (
	"io"
	"slices"
	"strings"
	"sync"

	"github.com/infernode/infernode/session/infer"
)

// Stream delivers one request's generated text. The engine never waits for a reader: text
// piles up in the stream (bounded by the request's token limit) until Recv takes it, so a
// slow reader costs memory, never engine time, and no text is dropped.
//
// Recv may be called from one goroutine at a time; Result from any goroutine once Recv has
// returned an error.
type Stream struct {
	mu      sync.Mutex
	pending strings.Builder
	done    bool
	res     infer.Result
	started bool          // admitted: PromptTokens and CachedTokens of res are set
	source  infer.Origin  // how the cached tokens came here
	tokens  int           // generated so far
	notify  chan struct{} // capacity 1: "something changed"

	// The generated tokens, the byte offset where each one's piece ends, and how far the
	// text the reader has received reaches into the pieces (see Continuation).
	ids     []int32
	ends    []int
	queued  int  // bytes of pieces behind the text pushed so far
	read    int  // bytes of pieces behind the text Recv returned
	inexact bool // some text differs from the pieces' bytes (invalid UTF-8 replaced)
	out     int  // bytes of text pushed
}

func newStream() *Stream { return &Stream{notify: make(chan struct{}, 1)} }

// Recv blocks until there is new text or the request ends. It returns text (possibly
// several tokens' worth) with a nil error; then io.EOF after a request that finished, or
// the request's error (ErrCanceled, ErrOverloaded, ErrClosed, ...) after one that failed.
// Every stream ends: the engine finishes each request it accepted.
func (s *Stream) Recv() (string, error) {
	for {
		s.mu.Lock()
		if s.pending.Len() > 0 {
			text := s.pending.String()
			s.pending.Reset()
			s.read = s.queued
			s.mu.Unlock()
			return text, nil
		}
		if s.done {
			err := s.res.Err
			s.mu.Unlock()
			if err == nil {
				err = io.EOF
			}
			return "", err
		}
		s.mu.Unlock()
		<-s.notify
	}
}

// Result is how the request ended. It is complete once Recv has returned an error.
func (s *Stream) Result() infer.Result {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.res
}

// Admitted reports the prompt's token count and how many of its tokens came from the
// conversation's cache, once the engine has admitted the request (always by the time Recv
// first returns).
func (s *Stream) Admitted() (promptTokens, cachedTokens int, ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.res.PromptTokens, s.res.CachedTokens, s.started
}

// Source says how the cached tokens came here (see infer.Origin), once admitted.
func (s *Stream) Source() infer.Origin {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.source
}

// Collect reads the stream to its end and returns all its text.
func (s *Stream) Collect() (string, infer.Result, error) {
	var b strings.Builder
	for {
		text, err := s.Recv()
		b.WriteString(text)
		if err != nil {
			res := s.Result()
			return b.String(), res, res.Err
		}
	}
}

// Tokens is how many tokens have been generated so far.
func (s *Stream) Tokens() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.tokens
}

// push adds one generated token's text (possibly empty) for the reader. Called by the
// engine only.
// push adds a generated token, tok, and the text now safe to send: end is where its
// piece ends among the pieces so far, held how many bytes of them the text filter holds
// back. Called by the engine only.
func (s *Stream) push(text string, tok int32, end, held int) {
	s.mu.Lock()
	s.tokens++
	s.pending.WriteString(text)
	s.ids, s.ends = append(s.ids, tok), append(s.ends, end)
	s.out += len(text)
	s.queued = end - held
	s.inexact = s.inexact || s.out != s.queued
	s.mu.Unlock()
	if text != "" {
		s.wake()
	}
}

// admit records the request's admission. Called by the engine only.
func (s *Stream) admit(promptTokens, cachedTokens int, source infer.Origin) {
	s.mu.Lock()
	s.started, s.res.PromptTokens, s.res.CachedTokens, s.source = true, promptTokens, cachedTokens, source
	s.mu.Unlock()
}

// pushText adds text that belongs to tokens already counted (held back until now).
func (s *Stream) pushText(text string) {
	s.mu.Lock()
	s.pending.WriteString(text)
	s.out += len(text)
	if n := len(s.ends); n > 0 {
		s.queued = s.ends[n-1]
	}
	s.inexact = s.inexact || s.out != s.queued
	s.mu.Unlock()
	s.wake()
}

// Continuation is the generated tokens whose pieces the text Recv has returned spells
// exactly, and how many bytes of that text lie past them (a token's piece partly sent);
// ok is false once some text did not spell the pieces' bytes (invalid UTF-8 replaced).
// A stream resumed elsewhere continues from these tokens rather than from its text. Only
// the tokens from the from-th on are returned (a reader asks for what it has not had).
func (s *Stream) Continuation(from int) (ids []int32, tail int, ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	n, _ := slices.BinarySearch(s.ends, s.read+1) // the tokens ending at or before read
	covered := 0
	if n > 0 {
		covered = s.ends[n-1]
	}
	return slices.Clone(s.ids[min(from, n):n]), s.read - covered, !s.inexact
}

// finish ends the stream. Called by the engine only, once.
func (s *Stream) finish(res infer.Result) {
	s.mu.Lock()
	s.done, s.res = true, res
	s.mu.Unlock()
	s.wake()
}

func (s *Stream) wake() {
	select {
	case s.notify <- struct{}{}:
	default:
	}
}

package session

import (
	"io"
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
func (s *Stream) push(text string) {
	s.mu.Lock()
	s.tokens++
	s.pending.WriteString(text)
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
	s.mu.Unlock()
	s.wake()
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

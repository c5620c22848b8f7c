package hop

import (
	"encoding/json"
	"errors"
	"io"
	"time"

	"github.com/infernode/infernode/session/infer"
)

// Answer is the owner's end of a hop's answer. It reads the engine's stream in its own
// goroutine, so that while the engine is silent (the request queued or prefilling) the
// owner still tells the entry node it is working.
type Answer struct {
	st        infer.Stream
	formatted string // see NewAnswer
	pieces    chan piece
	quit      chan struct{}
	held      *piece
}

// continuer is a stream that knows the tokens its text spells (session.Stream).
type continuer interface {
	Continuation(from int) (ids []int32, tail int, ok bool)
}

type piece struct {
	text   string
	ids    []int32 // the tokens the text spells that earlier pieces did not
	tail   int
	exact  bool
	err    error
	tokens int // generated with text: read at once, as the reader goes on to the next piece
}

// NewAnswer starts reading st. Write (or Close) must follow. formatted is the prompt this
// node formatted from the request's messages, or "" when it came as a prompt.
func NewAnswer(st infer.Stream, formatted string) *Answer {
	a := &Answer{st: st, formatted: formatted, pieces: make(chan piece), quit: make(chan struct{})}
	go func() {
		got := 0 // tokens of the continuation read so far
		for {
			text, err := st.Recv()
			p := piece{text: text, err: err, tokens: st.Tokens()}
			if c, ok := st.(continuer); ok && text != "" {
				p.ids, p.tail, p.exact = c.Continuation(got) // only the new ones: an answer's whole list each time would be quadratic
				got += len(p.ids)
			}
			select {
			case a.pieces <- p:
			case <-a.quit:
				return
			}
			if err != nil {
				return
			}
		}
	}()
	return a
}

// Wait waits up to d for the first piece of the answer. An error before any text is a
// refusal (overloaded, not ready): it is returned, to be answered with its status, so the
// entry node can try the next owner. After Wait the answer is committed: the caller sends
// its headers and calls Write.
func (a *Answer) Wait(d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case p := <-a.pieces:
		a.held = &p
		if p.text == "" && p.err != nil && !errors.Is(p.err, io.EOF) {
			return p.err
		}
	case <-t.C:
	}
	return nil
}

// Close stops reading the stream (the request's context ends it in the engine).
func (a *Answer) Close() { close(a.quit) }

// Write streams the answer through write, one line each: text events, a keep-alive line
// every keepAlive until the first text, then Done or Error. toError turns the engine's
// errors into what the entry node is told; ended runs after the last text of an answer
// that succeeded, before Done goes out. It returns write's first error (the entry node
// went away) and closes the answer.
func (a *Answer) Write(write func(line []byte) error, keepAlive time.Duration, toError func(error) *Error, ended func()) error {
	defer a.Close()
	event := func(ev Event) error {
		b, err := json.Marshal(ev)
		if err != nil {
			return err
		}
		return write(b)
	}
	tick := time.NewTicker(keepAlive)
	defer tick.Stop()
	first := true
	for {
		var p piece
		if a.held != nil {
			p, a.held = *a.held, nil
		} else {
			select {
			case p = <-a.pieces:
			case <-tick.C:
				if !first {
					continue // after the first token, tokens are the sign of life
				}
				if err := event(Event{}); err != nil {
					return err
				}
				continue
			}
		}
		if p.text != "" {
			ev := Event{Text: p.text, Tokens: p.tokens, IDs: p.ids, Tail: p.tail, Inexact: !p.exact}
			if first {
				ev.Prompt, ev.Cached, _ = a.st.Admitted()
				ev.Formatted, first = a.formatted, false
			}
			if err := event(ev); err != nil {
				return err
			}
		}
		if p.err != nil {
			break
		}
	}
	res := a.st.Result()
	if res.Err != nil {
		return event(Event{Error: toError(res.Err)})
	}
	ended()
	return event(Event{Done: &Done{FinishReason: res.FinishReason, PromptTokens: res.PromptTokens,
		CachedTokens: res.CachedTokens, CompletionTokens: res.CompletionTokens, Logprobs: res.Logprobs, PromptLogprobs: res.PromptLogprobs,
		FromCache: res.FromCache}})
}

package routing

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/infernode/infernode/session/infer"
)

// The hop: how one node hands a request to another. A POST to Path with a JSON Request
// body and the headers below; the answer is 200 with one JSON Event a line, or an error in
// OpenAI's JSON shape with its status. Both ends live in this file.
const (
	Path = "/internal/v1/generate"
	// KVPath takes a conversation's KV cache, as a KV frame (session's format), pushed by
	// the node that held it to the conversation's owner. Signed like a generation hop.
	KVPath = "/internal/v1/kv"
	// ReplicaPath takes a replica: a copy of a conversation's KV that its owner keeps on
	// the node that takes the conversation over if the owner fails.
	ReplicaPath = "/internal/v1/kv/replica"
	// PullPath answers with the KV frame of the conversation named in the body, for a
	// node that joined lately and now owns it (200), or nothing: 404 when it is not held
	// here, 204 when the asker would recompute it sooner than receive it.
	PullPath = "/internal/v1/kv/pull"

	// Major and Minor are the hop protocol version this node speaks. A new minor version
	// may add fields (receivers ignore fields they do not know); a new major one is not
	// understood by older nodes, which keep such peers off their rings.
	Major = 1
	// 1.1: keep-alive lines, and the first text event carries the prompt's counts.
	// 1.2: requests say whether they follow an earlier answer; KV pulls (PullPath).
	// 1.3: a chat for a model the entry node does not serve comes as messages, and the
	// first text event carries the prompt its owner formatted from them.
	Minor = 3

	HeaderVersion   = "X-Infernode-Hop-Version" // "major.minor"
	HeaderFrom      = "X-Infernode-Hop"         // the entry node's id
	HeaderTo        = "X-Infernode-Hop-To"      // the destination node's id
	HeaderTime      = "X-Infernode-Hop-Time"    // the sender's clock, Unix milliseconds
	HeaderNonce     = "X-Infernode-Hop-Nonce"   // 16 random bytes, hex
	HeaderSignature = "X-Infernode-Signature"   // hex HMAC-SHA256, see signature

	// NodeHeader names the node that served an answer; PromptHeader how many tokens its
	// prompt has and CachedHeader how many of them it found in its KV cache. Set on hop
	// answers and client answers alike.
	NodeHeader   = "X-Infernode-Node"
	PromptHeader = "X-Infernode-Prompt-Tokens"
	CachedHeader = "X-Infernode-Cached-Tokens"
	// HopsHeader counts the forwards behind an answer: 0 served where it entered, 1
	// forwarded once. Anything more breaks the one-hop rule.
	HopsHeader = "X-Infernode-Hops"
)

// Versions are the major versions of the hop protocol this node speaks, as gossiped.
var Versions = []int{Major}

// Request is a hop's body: one generation, with every field named on the wire.
type Request struct {
	Model            string    `json:"model"`
	SessionID        string    `json:"session_id"`
	FollowUp         bool      `json:"follow_up,omitempty"` // since 1.2
	Prompt           string    `json:"prompt"`
	Messages         []Message `json:"messages,omitempty"` // since 1.3: in place of Prompt, to format
	MaxTokens        int       `json:"max_tokens,omitempty"`
	Stop             []string  `json:"stop,omitempty"`
	Temperature      float32   `json:"temperature"`
	TopK             int       `json:"top_k,omitempty"`
	TopP             float32   `json:"top_p"`
	MinP             float32   `json:"min_p,omitempty"`
	RepeatPenalty    float32   `json:"repeat_penalty,omitempty"`
	PresencePenalty  float32   `json:"presence_penalty,omitempty"`
	FrequencyPenalty float32   `json:"frequency_penalty,omitempty"`
	RepeatLastN      int       `json:"repeat_last_n,omitempty"`
	Seed             int64     `json:"seed"`
	Logprobs         bool      `json:"logprobs,omitempty"`
	TopLogprobs      int       `json:"top_logprobs,omitempty"`
}

// Message is one message of a chat on the wire.
type Message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

func wireRequest(model string, r infer.Request) Request {
	s := r.Sampling
	var msgs []Message
	for _, m := range r.Messages {
		msgs = append(msgs, Message(m))
	}
	return Request{Model: model, SessionID: r.SessionID, FollowUp: r.FollowUp, Prompt: r.Prompt, Messages: msgs, MaxTokens: r.MaxTokens, Stop: r.Stop,
		Temperature: s.Temperature, TopK: s.TopK, TopP: s.TopP, MinP: s.MinP, RepeatPenalty: s.RepeatPenalty,
		PresencePenalty: s.PresencePenalty, FrequencyPenalty: s.FrequencyPenalty, RepeatLastN: s.RepeatLastN, Seed: s.Seed,
		Logprobs: r.Logprobs, TopLogprobs: r.TopLogprobs}
}

// Engine returns the request as the engine takes it.
func (r Request) Engine() infer.Request {
	var msgs []infer.Message
	for _, m := range r.Messages {
		msgs = append(msgs, infer.Message(m))
	}
	return infer.Request{SessionID: r.SessionID, FollowUp: r.FollowUp, Prompt: r.Prompt, Messages: msgs, MaxTokens: r.MaxTokens, Stop: r.Stop,
		Logprobs: r.Logprobs, TopLogprobs: r.TopLogprobs, Sampling: infer.Sampling{Temperature: r.Temperature, TopK: r.TopK, TopP: r.TopP, MinP: r.MinP,
			RepeatPenalty: r.RepeatPenalty, PresencePenalty: r.PresencePenalty, FrequencyPenalty: r.FrequencyPenalty,
			RepeatLastN: r.RepeatLastN, Seed: r.Seed}}
}

// Event is one line of a hop's answer: text, the end, an error, or (with no field set) a
// keep-alive: the owner is still working on a request that has no token yet.
type Event struct {
	Text   string `json:"t,omitempty"`
	Tokens int    `json:"n,omitempty"` // tokens generated so far
	// Prompt and Cached are the prompt's tokens and how many came from the KV cache, on
	// the first text event (the headers may have gone before admission).
	Prompt int `json:"p,omitempty"`
	Cached int `json:"c,omitempty"`
	// Formatted is the prompt the owner formatted from a request's messages, on the first
	// text event (since 1.3), so the entry node can resume the answer elsewhere.
	Formatted string `json:"f,omitempty"`
	Done      *Done  `json:"done,omitempty"`
	Error     *Error `json:"error,omitempty"`
}

// Done ends a successful answer.
type Done struct {
	FinishReason     string               `json:"finish_reason"`
	PromptTokens     int                  `json:"prompt_tokens"`
	CachedTokens     int                  `json:"cached_tokens"`
	CompletionTokens int                  `json:"completion_tokens"`
	Logprobs         []infer.TokenLogprob `json:"logprobs,omitempty"`
}

// Error is an error as it crosses the hop, in OpenAI's shape plus its HTTP status, so it
// keeps its meaning on the entry node (a 400 stays a 400, a 503 stays retryable).
type Error struct {
	Status     int    `json:"status,omitempty"`
	Message    string `json:"message"`
	Type       string `json:"type"`
	Param      any    `json:"param"`
	Code       any    `json:"code"`
	RetryAfter int    `json:"retry_after,omitempty"` // seconds
}

func (e *Error) Error() string { return e.Message }

// busy reports whether the peer that answered e is busy (overloaded, not ready, draining),
// not failing: the request may go to the next owner, and the peer's health is untouched.
func (e *Error) busy() bool { return e.Status == 503 }

// Errors of the receiving end. Test with errors.Is.
var (
	// ErrUnauthorized: the hop is unsigned, forged, stale or replayed (HTTP 401).
	ErrUnauthorized = errors.New("hop not authenticated")
	// ErrVersion: the hop's protocol major version is not spoken here (HTTP 400).
	ErrVersion = errors.New("hop protocol version not supported")
)

// Inbound is a received hop request, as node's HTTP server hands it over.
type Inbound struct {
	Method, Path string
	Header       func(name string) string
	Body         []byte
}

// Accept authenticates a hop addressed to this node and decodes its body. Fields a newer
// minor version added are ignored.
func (r *Router) Accept(in Inbound) (Request, error) {
	if err := r.Authenticate(in); err != nil {
		return Request{}, err
	}
	var req Request
	if err := json.Unmarshal(in.Body, &req); err != nil {
		return Request{}, fmt.Errorf("%w: hop body: %v", infer.ErrInvalid, err)
	}
	return req, nil
}

// Authenticate authenticates a hop addressed to this node (any path) and checks its protocol
// version; the body is the caller's to read.
func (r *Router) Authenticate(in Inbound) error {
	if err := r.auth.verify(in, r.cfg.Self); err != nil {
		return err
	}
	v := in.Header(HeaderVersion)
	major, _, _ := strings.Cut(v, ".")
	if n, err := strconv.Atoi(major); err != nil || n != Major {
		return fmt.Errorf("%w: got %q, this node speaks %d.x", ErrVersion, v, Major)
	}
	return nil
}

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

type piece struct {
	text   string
	err    error
	tokens int // generated with text: read at once, as the reader goes on to the next piece
}

// NewAnswer starts reading st. Write (or Close) must follow. formatted is the prompt this
// node formatted from the request's messages, or "" when it came as a prompt.
func NewAnswer(st infer.Stream, formatted string) *Answer {
	a := &Answer{st: st, formatted: formatted, pieces: make(chan piece), quit: make(chan struct{})}
	go func() {
		for {
			text, err := st.Recv()
			select {
			case a.pieces <- piece{text, err, st.Tokens()}:
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
			ev := Event{Text: p.text, Tokens: p.tokens}
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
		CachedTokens: res.CachedTokens, CompletionTokens: res.CompletionTokens, Logprobs: res.Logprobs}})
}

// auth signs and verifies hops with the cluster secret. A hop's signature covers its
// method, path, sender, destination, protocol version, timestamp, nonce and the SHA-256 of
// its body; a receiver refuses a timestamp more than maxSkew from its clock and any nonce it
// has seen within that window.
type auth struct {
	keys    [][]byte // the first signs, any verifies; none: insecure, hops unsigned and unchecked
	clock   Clock
	maxSkew time.Duration

	mu    sync.Mutex
	seen  map[string]time.Time // nonce → when it may be forgotten
	order []string             // nonces in arrival order, for pruning
}

func newAuth(key []byte, accept [][]byte, clock Clock, maxSkew time.Duration) *auth {
	a := &auth{clock: clock, maxSkew: maxSkew, seen: map[string]time.Time{}}
	if len(key) > 0 {
		a.keys = append([][]byte{key}, accept...)
	}
	return a
}

// sign sets the hop headers of a request from self to dest.
func (a *auth) sign(set func(name, value string), method, path, self, dest string, body []byte) {
	a.signHash(set, method, path, self, dest, sha256.Sum256(body))
}

// signHash is sign for a body of which only the SHA-256 is at hand.
func (a *auth) signHash(set func(name, value string), method, path, self, dest string, body [32]byte) {
	ts := strconv.FormatInt(a.clock.Now().UnixMilli(), 10)
	var n [16]byte
	rand.Read(n[:])
	nonce := hex.EncodeToString(n[:])
	version := fmt.Sprintf("%d.%d", Major, Minor)
	set(HeaderFrom, self)
	set(HeaderTo, dest)
	set(HeaderVersion, version)
	set(HeaderTime, ts)
	set(HeaderNonce, nonce)
	if len(a.keys) > 0 {
		set(HeaderSignature, hex.EncodeToString(mac(a.keys[0], method, path, self, dest, version, ts, nonce, body)))
	}
}

// mac is the signature of a hop whose body has the SHA-256 sum.
func mac(key []byte, method, path, from, to, version, ts, nonce string, sum [32]byte) []byte {
	m := hmac.New(sha256.New, key)
	for _, part := range []string{"infernode-hop", method, path, from, to, version, ts, nonce, hex.EncodeToString(sum[:])} {
		m.Write([]byte(part))
		m.Write([]byte{'\n'})
	}
	return m.Sum(nil)
}

// verify checks a hop addressed to self.
func (a *auth) verify(in Inbound, self string) error {
	if len(a.keys) == 0 {
		return nil
	}
	fail := func(why string) error { return fmt.Errorf("%w: %s", ErrUnauthorized, why) }
	sig, err := hex.DecodeString(in.Header(HeaderSignature))
	if err != nil || len(sig) == 0 {
		return fail("no signature")
	}
	to, ts, nonce := in.Header(HeaderTo), in.Header(HeaderTime), in.Header(HeaderNonce)
	sum := sha256.Sum256(in.Body)
	valid := false
	for _, k := range a.keys {
		valid = valid || hmac.Equal(sig, mac(k, in.Method, in.Path, in.Header(HeaderFrom), to, in.Header(HeaderVersion), ts, nonce, sum))
	}
	if !valid {
		return fail("bad signature")
	}
	if to != self {
		return fail(fmt.Sprintf("addressed to %q, this is %q", to, self))
	}
	ms, err := strconv.ParseInt(ts, 10, 64)
	now := a.clock.Now()
	if err != nil {
		return fail("bad timestamp")
	}
	if skew := now.Sub(time.UnixMilli(ms)).Abs(); skew > a.maxSkew {
		return fail(fmt.Sprintf("timestamp %v off this node's clock (more than %v)", skew.Round(time.Millisecond), a.maxSkew))
	}
	if len(nonce) != 32 {
		return fail("bad nonce")
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	for len(a.order) > 0 && now.After(a.seen[a.order[0]]) {
		delete(a.seen, a.order[0])
		a.order = a.order[1:]
	}
	if _, dup := a.seen[nonce]; dup {
		return fail("replayed nonce")
	}
	// A nonce must be remembered as long as its timestamp is acceptable: until ts+maxSkew.
	a.seen[nonce] = time.UnixMilli(ms).Add(a.maxSkew)
	a.order = append(a.order, nonce)
	return nil
}

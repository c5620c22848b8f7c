package hop

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"

	"github.com/infernode/infernode/session/infer"
)

// The hop: how one node hands a request to another. A POST to Path with a JSON Request
// body and the headers below; the answer is 200 with one JSON Event a line, or an error in
// OpenAI's JSON shape with its status.
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
	// StoredPath stores, fetches and deletes the Responses API's stored responses on the
	// nodes that keep a conversation (see node/stored). Since 1.7.
	StoredPath = "/internal/v1/stored"
	// QuotaPath leases capacity of a tenant's rate-limit bucket from the node that keeps
	// it (see node/quota). Since 1.7.
	QuotaPath = "/internal/v1/quota"

	// Major and Minor are the hop protocol version this node speaks. A new minor version
	// may add fields (receivers ignore fields they do not know); a new major one is not
	// understood by older nodes, which keep such peers off their rings.
	Major = 1
	// 1.1: keep-alive lines, and the first text event carries the prompt's counts.
	// 1.2: requests say whether they follow an earlier answer; KV pulls (PullPath).
	// 1.3: a chat for a model the entry node does not serve comes as messages, and the
	// first text event carries the prompt its owner formatted from them.
	// 1.4: a request's prefix-sharing domain (share). An owner of 1.3 or earlier would
	// ignore it and share cells across tenants, so a request with one goes only to owners
	// that gossip 1.4 or later (see MinorFor).
	// 1.5: a pull's answer is signed by the node asked, bound to the pull's nonce; a
	// pushed frame's signed headers carry its body's hash (HeaderBodyHash). A node asks
	// pulls only of peers that gossip 1.5 (MinorSignedPull): an older one's answer could
	// not be told from a forged one.
	// 1.6: a request's JSON schema (a response format) and, on a resumed leg, the text its
	// answer had (answered): an owner of 1.5 or earlier would ignore the schema.
	// 1.7: stored responses (StoredPath) and rate-limit leases (QuotaPath); a node sends
	// them only to peers of 1.7 or later.
	// A prompt as token ids, its logprobs, prefill only, an answer's tokens to continue
	// from (a request with any goes only to owners of 1.7: an older one would ignore
	// them); text events carry the tokens the text spells (Event.IDs).
	// 1.8: a request may ask for the owner's response cache (cache_answer; an older owner
	// computes the answer), and an answer's end says it came from there; a pull's answer
	// declares its frame's size (HeaderFrameBytes).
	// 1.9: a KV frame's signature may cover its BLAKE3-256 instead of its SHA-256 (see
	// Sum): a node pushes one so to peers of 1.9, and answers a pull of a 1.9 node so.
	// 1.10: a request may let its owner decline it (decline_above, see Request) for a
	// less loaded node; an older owner serves it, as before.
	Minor = 10

	// MinorStored is the least minor version that keeps stored responses, MinorQuota
	// rate-limit buckets.
	MinorStored = 7
	MinorQuota  = 7

	// MinorSignedPull is the least minor version whose pull answers are signed.
	MinorSignedPull = 5
	// MinorBLAKE3 is the least minor version that checks a KV frame's BLAKE3 (Sum).
	MinorBLAKE3 = 9

	HeaderVersion   = "X-Infernode-Hop-Version" // "major.minor"
	HeaderFrom      = "X-Infernode-Hop"         // the entry node's id
	HeaderTo        = "X-Infernode-Hop-To"      // the destination node's id
	HeaderTime      = "X-Infernode-Hop-Time"    // the sender's clock, Unix milliseconds
	HeaderNonce     = "X-Infernode-Hop-Nonce"   // 16 random bytes, hex
	HeaderSignature = "X-Infernode-Signature"   // hex HMAC-SHA256, see signature
	// HeaderBodyHash is the hex SHA-256 of a KV frame pushed (the body): the signature
	// covers it, so the receiver can check the signature when the headers arrive, and only
	// then accept a body larger than an API request's.
	HeaderBodyHash = "X-Infernode-Body-SHA256"
	// HeaderBodyBLAKE3 is, since 1.9, the hex BLAKE3-256 of a KV frame pushed or answering
	// a pull, in place of HeaderBodyHash (see Sum).
	HeaderBodyBLAKE3 = "X-Infernode-Body-BLAKE3"
	// HeaderKVWhy says KVWhyLeaving on a frame its owner pushes as it leaves the cluster
	// (a hand-off), so the next turn can say how its cache came (SourceHeader).
	HeaderKVWhy  = "X-Infernode-KV-Why"
	KVWhyLeaving = "leaving"
	// HeaderFrameBytes is the size of the KV frame a pull's answer streams, so that the
	// puller reads it into one buffer of that size (an older node does not send it).
	HeaderFrameBytes = "X-Infernode-Frame-Bytes"

	// NodeHeader names the node that served an answer; PromptHeader how many tokens its
	// prompt has and CachedHeader how many of them it found in its KV cache. Set on hop
	// answers and client answers alike.
	NodeHeader   = "X-Infernode-Node"
	PromptHeader = "X-Infernode-Prompt-Tokens"
	CachedHeader = "X-Infernode-Cached-Tokens"
	// SourceHeader says how the cached tokens came to the node that served the answer,
	// when they were imported: replica, handoff, push or pull (see infer.Origin).
	SourceHeader = "X-Infernode-KV-Source"
	// HopsHeader counts the forwards behind an answer: 0 served where it entered, 1
	// forwarded once. Anything more breaks the one-hop rule.
	HopsHeader = "X-Infernode-Hops"
)

// MinorOf is the minor version of a HeaderVersion value ("major.minor"), or -1.
func MinorOf(version string) int {
	_, minor, ok := strings.Cut(version, ".")
	n, err := strconv.Atoi(minor)
	if !ok || err != nil {
		return -1
	}
	return n
}

// Versions are the major versions of the hop protocol this node speaks, as gossiped.
var Versions = []int{Major}

// MinorFor is the least minor version an owner must speak to serve r as it asks: a field
// that changes what the owner must do needs an owner that knows it (an older one would
// ignore it), while fields that only add information do not.
func MinorFor(r infer.Request) int {
	if len(r.Tokens) > 0 || r.PromptLogprobs || r.PrefillOnly || len(r.Continue) > 0 {
		return 7
	}
	if r.Schema != "" {
		return 6
	}
	if r.Share != "" {
		return 4
	}
	return 0
}

// Request is a hop's body: one generation, with every field named on the wire.
type Request struct {
	Model            string    `json:"model"`
	SessionID        string    `json:"session_id"`
	Share            string    `json:"share,omitempty"`     // since 1.4
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
	Schema           string    `json:"schema,omitempty"`          // since 1.6
	Answered         string    `json:"answered,omitempty"`        // since 1.6
	Tokens           []int32   `json:"tokens,omitempty"`          // since 1.7
	PromptLogprobs   bool      `json:"prompt_logprobs,omitempty"` // since 1.7
	PrefillOnly      bool      `json:"prefill_only,omitempty"`    // since 1.7
	Continue         []int32   `json:"continue,omitempty"`        // since 1.7
	Batch            bool      `json:"batch,omitempty"`           // since 1.7
	CacheAnswer      bool      `json:"cache_answer,omitempty"`    // since 1.8
	// DeclineAbove, when above 0, lets the owner decline the request for another node
	// (503, code CodeDeclined, that node in HeaderPlaceTo): one it placed the conversation
	// on earlier, or, when it holds no KV of the conversation as its own and runs and
	// queues more than DeclineAbove requests, a less loaded one (see node/routing's
	// place.go). Since 1.10. Not part of the engine's request.
	DeclineAbove int `json:"decline_above,omitempty"`
}

// CodeDeclined is the code of an owner's busy answer to a request it declined (see
// Request.DeclineAbove); HeaderPlaceTo on it names the node to send the request to.
const (
	CodeDeclined  = "declined"
	HeaderPlaceTo = "X-Infernode-Place-To"
)

// Message is one message of a chat on the wire.
type Message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// NewRequest is r, for model, as it crosses the hop.
func NewRequest(model string, r infer.Request) Request {
	s := r.Sampling
	var msgs []Message
	for _, m := range r.Messages {
		msgs = append(msgs, Message(m))
	}
	return Request{Model: model, SessionID: r.SessionID, Share: r.Share, FollowUp: r.FollowUp, Prompt: r.Prompt, Messages: msgs, MaxTokens: r.MaxTokens, Stop: r.Stop,
		Temperature: s.Temperature, TopK: s.TopK, TopP: s.TopP, MinP: s.MinP, RepeatPenalty: s.RepeatPenalty,
		PresencePenalty: s.PresencePenalty, FrequencyPenalty: s.FrequencyPenalty, RepeatLastN: s.RepeatLastN, Seed: s.Seed,
		Logprobs: r.Logprobs, TopLogprobs: r.TopLogprobs, Schema: r.Schema, Answered: r.Answered,
		Tokens: r.Tokens, PromptLogprobs: r.PromptLogprobs, PrefillOnly: r.PrefillOnly, Continue: r.Continue, Batch: r.Batch,
		CacheAnswer: r.CacheAnswer}
}

// Engine returns the request as the engine takes it.
func (r Request) Engine() infer.Request {
	var msgs []infer.Message
	for _, m := range r.Messages {
		msgs = append(msgs, infer.Message(m))
	}
	return infer.Request{SessionID: r.SessionID, Share: r.Share, FollowUp: r.FollowUp, Prompt: r.Prompt, Messages: msgs, MaxTokens: r.MaxTokens, Stop: r.Stop,
		Logprobs: r.Logprobs, TopLogprobs: r.TopLogprobs, Schema: r.Schema, Answered: r.Answered,
		Tokens: r.Tokens, PromptLogprobs: r.PromptLogprobs, PrefillOnly: r.PrefillOnly, Continue: r.Continue, Batch: r.Batch, CacheAnswer: r.CacheAnswer, Sampling: infer.Sampling{Temperature: r.Temperature, TopK: r.TopK, TopP: r.TopP, MinP: r.MinP,
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
	// Since 1.7, on text events: the tokens whose pieces the text so far now spells
	// exactly (those since the last event), and how many bytes of the text lie past them;
	// Inexact once some text did not spell its pieces. The entry node resumes the answer
	// elsewhere from these tokens (Request.Continue), not from its text.
	IDs     []int32 `json:"i,omitempty"`
	Tail    int     `json:"r,omitempty"`
	Inexact bool    `json:"x,omitempty"`
	Done    *Done   `json:"done,omitempty"`
	Error   *Error  `json:"error,omitempty"`
}

// Done ends a successful answer.
type Done struct {
	FinishReason     string               `json:"finish_reason"`
	PromptTokens     int                  `json:"prompt_tokens"`
	CachedTokens     int                  `json:"cached_tokens"`
	CompletionTokens int                  `json:"completion_tokens"`
	Logprobs         []infer.TokenLogprob `json:"logprobs,omitempty"`
	PromptLogprobs   []infer.TokenLogprob `json:"prompt_logprobs,omitempty"` // since 1.7
	FromCache        bool                 `json:"response_cached,omitempty"` // since 1.8
}

// Error is an error as a client or a peer is told it: OpenAI's shape plus its HTTP status,
// so that it keeps its meaning across the hop (a 400 stays a 400, a 503 stays retryable).
// It is node's API error type too: there is one.
type Error struct {
	Status     int    `json:"status,omitempty"`
	Message    string `json:"message"`
	Type       string `json:"type"`
	Param      any    `json:"param"`
	Code       any    `json:"code"`
	RetryAfter int    `json:"retry_after,omitempty"` // seconds
	PlaceTo    string `json:"-"`                     // a declining owner's choice (HeaderPlaceTo)
}

func (e *Error) Error() string { return e.Message }

// Busy reports whether the node that answered e is busy (overloaded, not ready,
// draining), not failing: the request may go to the next owner, and the peer's health is
// untouched.
func (e *Error) Busy() bool { return e.Status == 503 }

// Body is e as an HTTP error body, to clients and peers alike: OpenAI's
// {"error": {"message", "type", "param", "code"}}. The status and Retry-After travel as
// HTTP's own; only an error event inside an answer's stream carries them in the JSON.
func (e *Error) Body() []byte {
	b, _ := json.Marshal(struct {
		Error apiError `json:"error"`
	}{apiError{e.Message, e.Type, e.Param, e.Code}})
	return b
}

type apiError struct {
	Message string `json:"message"`
	Type    string `json:"type"`
	Param   any    `json:"param"`
	Code    any    `json:"code"`
}

// DecodeError rebuilds a peer's error answer, so it keeps its meaning across the hop.
func DecodeError(resp *http.Response) *Error {
	var e struct {
		Error *Error `json:"error"`
	}
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	if json.Unmarshal(b, &e) != nil || e.Error == nil {
		return &Error{Status: resp.StatusCode, Type: "server_error", Message: fmt.Sprintf("peer answered %d", resp.StatusCode)}
	}
	e.Error.Status = resp.StatusCode
	if ra, err := strconv.Atoi(resp.Header.Get("Retry-After")); err == nil {
		e.Error.RetryAfter = ra
	}
	e.Error.PlaceTo = resp.Header.Get(HeaderPlaceTo)
	return e.Error
}

// URL is the address of path on the node whose API listens at addr (host:port).
func URL(addr, path string) string {
	return (&url.URL{Scheme: "http", Host: addr, Path: path}).String()
}

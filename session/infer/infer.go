package infer

import (
	"errors"
	"fmt"
	"io"
	"math"
	"time"
)

// Request is one generation: a prompt (already formatted, for example by ApplyChatTemplate)
// and how to sample its continuation.
type Request struct {
	// SessionID names the conversation. Turns with the same id reuse its cached KV.
	// Empty means no conversation: the request uses a free slot and nothing is kept for it.
	SessionID string
	// FollowUp: the prompt continues an earlier answer (a chat turn after an assistant
	// message), so its conversation's KV may be held by another node (routing pulls it).
	FollowUp bool
	// Prompt is the text to continue. Control tokens written as text (such as
	// <|im_start|>) are parsed as such.
	Prompt string
	// Tokens, if set, is the prompt as the model's token ids, used as they are (no
	// beginning-of-sequence token is added) in place of Prompt, which then only names it
	// (for routing and logs).
	Tokens []int32
	// Batch marks background work (OpenAI's "flex" service tier): it is admitted only when
	// no interactive request waits and a sequence stays free for one, its prompt is
	// prefilled after interactive prompts, its decoding pauses while an interactive prompt
	// is prefilled, an interactive request that finds no room preempts it (its KV copied
	// out, to resume where it stopped), and the queue refuses it once half full, before any
	// interactive request is refused. Interactive work keeps its latency; batch work fills
	// what is left.
	Batch bool
	// Continue, if set, are tokens that follow the prompt's (an answer's tokens so far, when
	// it resumes on another node): the engine appends them to the tokenized prompt as they
	// are, and a schema's grammar follows them, so the answer goes on exactly as it would
	// have (text tokenized afresh may split differently).
	Continue []int32
	// PromptLogprobs asks for the log probability of every prompt token after the first
	// (and TopLogprobs alternatives) in Result.PromptLogprobs, as evaluation harnesses
	// score a text: the prompt is computed whole, its cached KV not reused. PrefillOnly
	// generates nothing (finish reason "length"): the prompt's score alone.
	PromptLogprobs, PrefillOnly bool
	// Messages is a chat to format with the serving model's chat template, in place of
	// Prompt, from a node that does not serve the request's model: routing forwards it to
	// one that does, which formats it. Engines take Prompt only.
	Messages []Message
	// MaxTokens caps the generated tokens; 0 means Config.DefaultMaxTokens. Generation
	// also stops where the sequence's context ends (finish reason "length").
	MaxTokens int
	// Stop strings end generation where they first appear; they are never emitted.
	Stop []string
	// Share is the request's prefix-sharing domain: its prompt may reuse KV cells that
	// another conversation holds only when that conversation's domain is the same (one
	// tenant, and one cache salt within it). Conversations of different domains never
	// share cells, so none can learn another's prompt from the cache (by a counter or by
	// time to first token).
	Share string
	// Logprobs asks for the log probability of every generated token (under the model's
	// own distribution, before sampling settings), and TopLogprobs (0 to 20) for that
	// many of the most likely tokens at each position, in Result.Logprobs.
	Logprobs    bool
	TopLogprobs int
	// Schema, if set, is a JSON schema the answer must match (a response format): the
	// engine compiles it to a grammar, and every token is sampled among those it allows.
	Schema string
	// Answered is the text this answer generated before it moved to this node (a resumed
	// stream, whose prompt ends with it): the schema's grammar follows it first, so the
	// answer matches as a whole.
	Answered string
	// CacheAnswer lets the answer come from, and go to, the serving node's exact-match
	// response cache when it is a function of the request (greedy; see node/answers).
	CacheAnswer bool
	Sampling
}

// PrefixBlock is the tokens of one block of a prefix digest: a node tells its peers which
// prompt beginnings it holds in whole blocks (see session's Prefixes).
const PrefixBlock = 32

// ContentMark delimits data inside a prompt: message contents in a formatted chat, and the
// text an answer had generated when it resumes on another owner. The engine tokenizes what
// lies between two marks without turning control-token text (such as
// "<|im_start|>system") into control tokens, so only the template places them. The mark
// is U+FDD0, a Unicode noncharacter (reserved for a program's internal use, and a valid
// byte sequence in the C strings llama.cpp's templates take); content may not contain it,
// nor NUL.
const ContentMark = "\uFDD0"

// TokenLogprob is one generated token's log probability and the most likely alternatives.
type TokenLogprob struct {
	Token   string       `json:"token"`
	Logprob float32      `json:"logprob"`
	Top     []TopLogprob `json:"top,omitempty"`
}

// TopLogprob is one of the most likely tokens at a position.
type TopLogprob struct {
	Token   string  `json:"token"`
	Logprob float32 `json:"logprob"`
}

// MaxTopLogprobs bounds Request.TopLogprobs, as OpenAI does.
const MaxTopLogprobs = 20

// Sampling says how to choose each token. Start from DefaultSampling or Greedy: the zero
// value is not valid (TopP 0).
type Sampling struct {
	Temperature      float32 // [0, 2]; 0 is greedy
	TopK             int     // 0 disables
	TopP             float32 // (0, 1]; 1 disables
	MinP             float32 // [0, 1]; 0 disables
	RepeatPenalty    float32 // [0, 10]; 0 or 1 disables
	PresencePenalty  float32 // [-2, 2]
	FrequencyPenalty float32 // [-2, 2]
	RepeatLastN      int     // tokens the penalties look back over; 0 means 64
	Seed             int64   // [0, 2^32) for a reproducible draw, -1 for a random one
}

// DefaultSampling is OpenAI's default: temperature 1, no truncation, a random seed.
func DefaultSampling() Sampling { return Sampling{Temperature: 1, TopP: 1, Seed: -1} }

// Greedy always picks the most likely token.
func Greedy() Sampling { return Sampling{Temperature: 0, TopP: 1} }

// Sentinel errors. Test with errors.Is.
var (
	// ErrInvalid is wrapped by every *InvalidError: the request is wrong and retrying it
	// unchanged will not help.
	ErrInvalid = errors.New("invalid request")
	// ErrPromptTooLong means the prompt does not fit a sequence's context. It wraps
	// ErrInvalid.
	ErrPromptTooLong = fmt.Errorf("%w: prompt too long", ErrInvalid)
	// ErrOverloaded means the request could not be admitted: the queue was full or the
	// request waited longer than Config.QueueTimeout. Retrying later may succeed.
	ErrOverloaded = errors.New("engine overloaded")
	// ErrCanceled means the request's context ended before it finished. It wraps the
	// context's error too.
	ErrCanceled = errors.New("request canceled")
	// ErrClosed means the engine is not running.
	ErrClosed = errors.New("engine closed")
	// ErrFrame is wrapped by every error about a KV frame that cannot be imported: another
	// model or KV layout, another format version, a truncated or corrupt frame.
	ErrFrame = errors.New("bad KV frame")
	// ErrNotCached means the engine holds no idle cache for the conversation asked for.
	ErrNotCached = errors.New("conversation not cached here")
)

// Origin says how the KV cache a turn started from came to the node serving it.
type Origin string

const (
	Local   Origin = ""        // earlier turns ran here (or nothing was cached)
	Replica Origin = "replica" // the copy its owner kept here after each turn
	HandOff Origin = "handoff" // pushed by its owner as that node left the cluster
	Pushed  Origin = "push"    // pushed by its previous owner when ownership moved (a join, a degraded member)
	Pulled  Origin = "pull"    // asked of its previous owner on a miss, by a node that joined
	// Prefilled: a prefill node computed it for this turn (disaggregated prefill).
	Prefilled Origin = "prefill"
	// Prefix: the beginning of a new conversation's prompt, pulled from a peer that held
	// it for another conversation (routing's prefix digests).
	Prefix Origin = "prefix"
	// ResponseCache: the whole answer came from the response cache (see node/answers).
	ResponseCache Origin = "response_cache"
)

// Imported says what importing a KV frame installed.
type Imported struct {
	Key    string        `json:"key"`
	Tokens int           `json:"tokens"`
	Bytes  int           `json:"bytes"`    // of llama.cpp state
	Stall  time.Duration `json:"stall_ns"` // the engine's time spent installing it, between steps
}

// Frame is a conversation's KV copied out of an engine, written as a KV frame (session's
// format) as many times as asked: once to hash it for a signature, once to send it, so the
// frame itself is never held in memory. Release returns its buffer to the engine.
type Frame interface {
	WriteTo(w io.Writer) (int64, error)
	Len() int    // bytes WriteTo writes
	Tokens() int // tokens it holds
	Release()
}

// InvalidError says which parameter of a request is wrong and why.
type InvalidError struct {
	Param  string // the request field, as OpenAI names it
	Reason string
}

func (e *InvalidError) Error() string { return fmt.Sprintf("invalid %s: %s", e.Param, e.Reason) }

// Is makes errors.Is(err, ErrInvalid) true for every InvalidError.
func (e *InvalidError) Is(target error) bool { return target == ErrInvalid }

// OverloadedError is ErrOverloaded with the engine's estimate of when to retry: how long
// its queue takes to drain at the rate it has been finishing requests.
type OverloadedError struct {
	Reason     string // "queue full" or "queue timeout"
	RetryAfter time.Duration
}

func (e *OverloadedError) Error() string {
	return fmt.Sprintf("engine overloaded (%s); retry in %v", e.Reason, e.RetryAfter)
}

// Is makes errors.Is(err, ErrOverloaded) true.
func (e *OverloadedError) Is(target error) bool { return target == ErrOverloaded }

// PromptTooLongError reports a prompt that cannot fit.
type PromptTooLongError struct {
	Tokens, Limit int
	// Bytes, when set, is the prompt's length in bytes, refused before tokenizing: more
	// than Limit tokens of the longest piece the vocabulary has.
	Bytes int
}

func (e *PromptTooLongError) Error() string {
	if e.Bytes > 0 {
		return fmt.Sprintf("prompt is %d bytes, more than the %d tokens a sequence can hold with room to generate could spell", e.Bytes, e.Limit)
	}
	return fmt.Sprintf("prompt is %d tokens, more than the %d a sequence can hold with room to generate", e.Tokens, e.Limit)
}

// Is makes errors.Is(err, ErrPromptTooLong) and errors.Is(err, ErrInvalid) true.
func (e *PromptTooLongError) Is(target error) bool {
	return target == ErrPromptTooLong || target == ErrInvalid
}

// Limits on what a request may ask for.
const (
	maxStops      = 16
	maxStopLength = 256
)

// Validate checks every parameter and reports the first wrong one.
func (r *Request) Validate() error {
	bad := func(param, format string, args ...any) error {
		return &InvalidError{Param: param, Reason: fmt.Sprintf(format, args...)}
	}
	finite := func(x float32) bool { return !math.IsNaN(float64(x)) && !math.IsInf(float64(x), 0) }
	s := r.Sampling
	switch {
	case r.Prompt == "" && len(r.Messages) == 0 && len(r.Tokens) == 0:
		return bad("prompt", "must not be empty")
	case r.MaxTokens < 0:
		return bad("max_tokens", "must not be negative, got %d", r.MaxTokens)
	case !finite(s.Temperature) || s.Temperature < 0 || s.Temperature > 2:
		return bad("temperature", "must be in [0, 2], got %v", s.Temperature)
	case !finite(s.TopP) || s.TopP <= 0 || s.TopP > 1:
		return bad("top_p", "must be in (0, 1], got %v", s.TopP)
	case s.TopK < 0:
		return bad("top_k", "must not be negative, got %d", s.TopK)
	case !finite(s.MinP) || s.MinP < 0 || s.MinP > 1:
		return bad("min_p", "must be in [0, 1], got %v", s.MinP)
	case !finite(s.RepeatPenalty) || s.RepeatPenalty < 0 || s.RepeatPenalty > 10:
		return bad("repeat_penalty", "must be in [0, 10], got %v", s.RepeatPenalty)
	case !finite(s.PresencePenalty) || s.PresencePenalty < -2 || s.PresencePenalty > 2:
		return bad("presence_penalty", "must be in [-2, 2], got %v", s.PresencePenalty)
	case !finite(s.FrequencyPenalty) || s.FrequencyPenalty < -2 || s.FrequencyPenalty > 2:
		return bad("frequency_penalty", "must be in [-2, 2], got %v", s.FrequencyPenalty)
	case s.RepeatLastN < 0:
		return bad("repeat_last_n", "must not be negative, got %d", s.RepeatLastN)
	case s.Seed < -1 || s.Seed > math.MaxUint32:
		return bad("seed", "must be -1 (random) or in [0, %d], got %d", uint32(math.MaxUint32), s.Seed)
	case len(r.Stop) > maxStops:
		return bad("stop", "at most %d stop strings, got %d", maxStops, len(r.Stop))
	case r.TopLogprobs < 0 || r.TopLogprobs > MaxTopLogprobs:
		return bad("top_logprobs", "must be in [0, %d], got %d", MaxTopLogprobs, r.TopLogprobs)
	case r.TopLogprobs > 0 && !r.Logprobs && !r.PromptLogprobs:
		return bad("top_logprobs", "needs logprobs: true")
	case r.PrefillOnly && r.Logprobs:
		return bad("logprobs", "a prefill-only request generates no token to score")
	}
	for _, stop := range r.Stop {
		if stop == "" || len(stop) > maxStopLength {
			return bad("stop", "stop strings must be 1 to %d bytes long", maxStopLength)
		}
	}
	return nil
}

// Result is how a request ended.
type Result struct {
	// FinishReason is "stop" (end of turn or a stop string) or "length" (token limit or
	// end of context). Empty when the request failed.
	FinishReason string
	// PromptTokens counts the prompt's tokens; CachedTokens how many of them were reused
	// from the conversation's KV cache rather than prefilled.
	PromptTokens, CachedTokens int
	// CompletionTokens counts generated tokens, including a final end-of-turn token.
	CompletionTokens int
	// Queued is the time from Submit to admission; FirstToken from Submit to the first
	// generated token; Total from Submit to the end.
	Queued, FirstToken, Total time.Duration
	// Logprobs are the generated tokens' log probabilities, when the request asked.
	Logprobs []TokenLogprob
	// PromptLogprobs are the prompt's tokens, when the request asked (PromptLogprobs): the
	// first with Logprob 0 (nothing precedes it), then each with its log probability.
	PromptLogprobs []TokenLogprob
	// FromCache: the answer was replayed from the response cache (see node/answers).
	FromCache bool
	// Err is why the request failed, or nil.
	Err error
}

// Message is one turn of a chat.
type Message struct {
	Role, Content string
}

// Stream is one generation's output as its reader sees it. session.Stream implements it
// for the local engine; routing's streams implement it for answers from peers.
// Implementations are safe for one reader and concurrent calls of Result and Tokens.
type Stream interface {
	// Recv returns the next piece of text; io.EOF after the last one, or the error that
	// ended generation.
	Recv() (string, error)
	// Result is how the request ended, once Recv has returned an error.
	Result() Result
	// Admitted reports the prompt's size and how much of it came from cache, once the
	// request has been admitted (ok false before).
	Admitted() (promptTokens, cachedTokens int, ok bool)
	// Source says how the cached tokens came to the node serving the request (Local when
	// a turn ran there since, or none were cached), once admitted.
	Source() Origin
	// Tokens is how many tokens have been generated so far.
	Tokens() int
}

// Stats is a snapshot of an engine, updated after every step.
type Stats struct {
	Sequences      int // requests that may run at once
	Running        int // requests being prefilled or decoded
	Waiting        int // requests queued for admission, parked ones included
	Parked         int // batch requests preempted for interactive work, to resume (KV kept)
	Conversations  int // idle conversations with cached KV, replicas included
	Replicas       int // of them, copies kept for other nodes' conversations
	KVCells        int // cells in the KV cache
	KVUsed         int // cells holding tokens, as llama.cpp reports
	KVActive       int // of them, cells of requests running (not idle conversations, which may be evicted)
	PromptTokens   uint64
	ReusedTokens   uint64 // prompt tokens served from the conversation's cache instead of prefilled
	SharedTokens   uint64 // prompt tokens whose cells another conversation with the same beginning held
	Generated      uint64
	Evictions      uint64 // idle conversations evicted to make room
	Preemptions    uint64 // batch requests parked, their KV copied out, to make room for interactive ones
	HostMoves      uint64 // idle conversations whose cells were moved out of the pool to host memory
	HostTokens     int    // tokens of the idle conversations whose cells are in host memory now
	Canceled       uint64 // requests ended by their context
	Refused        uint64 // requests refused as overloaded
	Steps          uint64
	BatchedTokens  uint64 // tokens decoded over all steps
	MaxDecoding    int    // the most sequences that decoded a token in one step
	StepTimeMicros uint64 // time spent in llama_decode over all steps
	// PrefillRate is prompt tokens prefilled a second at the load the engine has had
	// lately: a moving average over steps that prefilled, decoding beside them included.
	// 0 until the engine has prefilled a prompt.
	PrefillRate float64
}

package session

import "github.com/infernode/infernode/session/infer"

// The engine's plain types live in package infer (no cgo), so the layers above can be
// built and tested without llama.cpp. These aliases keep session's own API whole.
type (
	Request            = infer.Request
	Sampling           = infer.Sampling
	Result             = infer.Result
	Stats              = infer.Stats
	Message            = infer.Message
	InvalidError       = infer.InvalidError
	PromptTooLongError = infer.PromptTooLongError
	OverloadedError    = infer.OverloadedError
	ImportResult       = infer.Imported
	TokenLogprob       = infer.TokenLogprob
	TopLogprob         = infer.TopLogprob
)

// Sentinel errors; see package infer.
var (
	ErrInvalid       = infer.ErrInvalid
	ErrPromptTooLong = infer.ErrPromptTooLong
	ErrOverloaded    = infer.ErrOverloaded
	ErrCanceled      = infer.ErrCanceled
	ErrClosed        = infer.ErrClosed
	ErrFrame         = infer.ErrFrame
	ErrNotCached     = infer.ErrNotCached
)

// DefaultSampling is OpenAI's default: temperature 1, no truncation, a random seed.
func DefaultSampling() Sampling { return infer.DefaultSampling() }

// Greedy always picks the most likely token.
func Greedy() Sampling { return infer.Greedy() }

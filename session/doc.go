// Package session is infernode's inference engine: one llama.cpp context, many
// conversations, continuous batching.
//
// One goroutine (Engine.Run) owns the llama.cpp context. Callers Submit requests from any
// goroutine and read the answer from a Stream. Every step of the loop decodes one token for
// each running sequence and spends the rest of the step on prefill chunks of newly admitted
// requests, shortest prompt first, within a time slice while others decode; requests join
// between steps and leave as soon as they finish.
//
// A conversation (a request's SessionID) keeps its tokens and KV cells in a sequence slot
// after its turn ends. Its next turn reuses the longest cached token prefix and prefills
// only the rest. Idle conversations are evicted least recently used first when slots or KV
// cells run out; running ones never are. Requests that cannot be admitted wait in a bounded
// queue and are refused with ErrOverloaded when it is full or they have waited too long.
//
// The engine runs on a Backend: llama.cpp's model and context (session/llama, the only
// cgo), or in the scheduler's tests a deterministic fake, under testing/synctest's virtual
// clock, so placement, sharing, admission and timeouts are tested in milliseconds without a
// model (sched_fake_test.go); the tests with a real model check the text (engine_test.go).
//
// session knows nothing about HTTP, peers or chat formats beyond the model's own template:
// callers hand it text prompts and sampling parameters.
package session

package session

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/infernode/infernode/session/infer"
)

// The scheduler on a fake backend (fake_test.go), without a model: placement, reuse,
// prefix sharing, eviction, admission and timeouts, in virtual time (testing/synctest), in
// milliseconds. The real model's tests (engine_test.go) check the same engine computes the
// right text on llama.cpp.

// TestFakeBatching: more requests than sequences, of different lengths, all at once: each
// answer is exactly the model's, however the steps batched, queued and prefilled them.
func TestFakeBatching(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		e, b, stop := startFake(t, func(c *Config) { c.BatchSize = 16 })
		defer stop()
		var wg sync.WaitGroup
		for i := range 10 {
			wg.Go(func() {
				prompt := strings.Repeat(fmt.Sprint("word", i, " "), 1+i*7) // 1 to 64 words: several prefill chunks
				text, res, _ := ask(t, e, fmt.Sprint("c", i), prompt, 5+i)
				if want := answer(prompt, 5+i); text != want || res.FinishReason != "length" {
					t.Errorf("request %d: %q (%s), want %q", i, text, res.FinishReason, want)
				}
			})
		}
		wg.Wait()
		if st := e.Stats(); st.MaxDecoding < 2 || b.decodes >= 10*20 {
			t.Errorf("no batching: at most %d decoding at once, %d decodes", st.MaxDecoding, b.decodes)
		}
	})
}

// TestFakeConversationReuse: a conversation's next turn finds its earlier tokens cached
// and prefills only the rest; another conversation with the same words finds nothing of
// it (no prefix under minSharedPrefix is shared); the answers are the model's.
func TestFakeConversationReuse(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		e, _, stop := startFake(t, nil)
		defer stop()
		first := "the river runs to the sea"
		text, _, cached := ask(t, e, "conv", first, 4)
		if cached != 0 {
			t.Fatalf("first turn: %d cached", cached)
		}
		next := first + text + " and then"
		text2, _, cached := ask(t, e, "conv", next, 4)
		// Cached: BOS, the prompt's 6 words and the 3 answer tokens fed back (the 4th was
		// never decoded).
		if cached != 1+6+3 || text2 != answer(next, 4) {
			t.Errorf("second turn: %d cached, %q; want 10 cached, %q", cached, text2, answer(next, 4))
		}
		if _, _, cached := ask(t, e, "other", next, 4); cached != 0 {
			t.Errorf("another conversation found %d tokens cached", cached)
		}
	})
}

// TestFakePrefixSharing: in a unified pool a conversation that begins as another one does
// (a long shared system prompt) shares its cells and prefills only the rest, and its
// answer is still the model's; without a unified pool nothing is shared.
func TestFakePrefixSharing(t *testing.T) {
	for _, unified := range []bool{true, false} {
		t.Run(fmt.Sprint("unified=", unified), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				e, _, stop := startFake(t, func(c *Config) { c.UnifiedKV = unified })
				defer stop()
				system := strings.Repeat("you answer about rivers ", 10) // 40 words
				ask(t, e, "a", system+"first question", 3)
				p := system + "second question here"
				text, _, _ := ask(t, e, "b", p, 3)
				shared := e.Stats().SharedTokens
				if text != answer(p, 3) {
					t.Errorf("answer after sharing: %q, want %q", text, answer(p, 3))
				}
				if want := uint64(1 + 40); unified && shared != want || !unified && shared != 0 {
					t.Errorf("shared %d tokens, want %d", shared, map[bool]uint64{true: want, false: 0}[unified])
				}
			})
		})
	}
}

// TestFakeEviction: with every slot holding an idle conversation, a new one evicts the
// least recently used, and that conversation's next turn is cold; a running request is
// never evicted.
func TestFakeEviction(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		e, _, stop := startFake(t, func(c *Config) { c.Sequences, c.Conversations = 2, 2 })
		defer stop()
		ask(t, e, "a", "alpha one", 2)
		ask(t, e, "b", "beta one", 2)
		ask(t, e, "a", "alpha one t1 t2 more", 2) // a is used last: b goes first
		ask(t, e, "c", "gamma one", 2)
		if st := e.Stats(); st.Evictions != 1 {
			t.Errorf("%d evictions, want 1", st.Evictions)
		}
		if _, _, cached := ask(t, e, "b", "beta one t1 t2 more", 2); cached != 0 {
			t.Errorf("evicted b found %d cached", cached)
		}
		if _, _, cached := ask(t, e, "c", "gamma one again", 2); cached == 0 {
			t.Error("c, used after b's eviction, lost its cache")
		}
	})
}

// TestFakeConversations: a unified pool holds more conversations than it runs requests
// at once (Conversations, by default 4x Sequences): six conversations on an engine of
// two sequences all find their histories at their next turns, while no more than two
// requests ever run at once, even when all six ask together.
func TestFakeConversations(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		e, _, stop := startFake(t, func(c *Config) { c.Sequences = 2 })
		defer stop()
		texts := make([]string, 6)
		for i := range texts {
			texts[i], _, _ = ask(t, e, fmt.Sprint("c", i), fmt.Sprint("opening words of conversation ", i), 2)
		}
		var wg sync.WaitGroup
		for i, text := range texts {
			wg.Go(func() {
				if _, _, cached := ask(t, e, fmt.Sprint("c", i), fmt.Sprint("opening words of conversation ", i, text, " go on"), 2); cached == 0 {
					t.Errorf("conversation %d's next turn found nothing cached", i)
				}
			})
		}
		wg.Wait()
		if st := e.Stats(); st.Evictions != 0 || st.MaxDecoding > 2 || st.Sequences != 2 || st.Conversations != 6 {
			t.Errorf("%d evictions, %d decoding at once, %d sequences, %d conversations held: want 0, at most 2, 2, 6",
				st.Evictions, st.MaxDecoding, st.Sequences, st.Conversations)
		}
	})
}

// TestFakeQueue: a request that cannot be admitted waits; past QueueTimeout it is
// refused with a Retry-After, and past MaxQueue requests are refused at once. Virtual
// time: the test takes milliseconds.
func TestFakeQueue(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		e, b, stop := startFake(t, func(c *Config) { c.Sequences, c.MaxQueue, c.QueueTimeout = 1, 1, 2*time.Second })
		defer stop()
		b.perToken = 100 * time.Millisecond // the running request takes 10s
		long, err := e.Submit(t.Context(), infer.Request{Prompt: "a long one", MaxTokens: 100, Sampling: infer.Greedy()})
		if err != nil {
			t.Fatal(err)
		}
		synctest.Wait()
		start := time.Now()
		waiting, err := e.Submit(t.Context(), infer.Request{Prompt: "waits", MaxTokens: 1, Sampling: infer.Greedy()})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := e.Submit(t.Context(), infer.Request{Prompt: "one too many", MaxTokens: 1, Sampling: infer.Greedy()}); !errors.Is(err, infer.ErrOverloaded) {
			t.Errorf("past MaxQueue: %v, want ErrOverloaded at once", err)
		}
		_, res, err := waiting.Collect()
		var o *infer.OverloadedError
		if !errors.As(err, &o) || o.Reason != "queue timeout" || o.RetryAfter < time.Second {
			t.Errorf("a request that waited: %v (%+v), want refused after the queue timeout", err, res)
		}
		if waited := time.Since(start); waited < 2*time.Second || waited > 2*time.Second+200*time.Millisecond {
			t.Errorf("refused after %v, want the queue timeout, 2s", waited)
		}
		if _, res, err := long.Collect(); err != nil || res.CompletionTokens != 100 {
			t.Errorf("the running request: %v, %d tokens", err, res.CompletionTokens)
		}
	})
}

// TestFakeCancel: canceling a running request ends it at once with ErrCanceled and frees
// its sequence for the next; a request canceled while queued never runs.
func TestFakeCancel(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		e, b, stop := startFake(t, func(c *Config) { c.Sequences = 1 })
		defer stop()
		b.perToken = 10 * time.Millisecond
		ctx, cancel := context.WithCancel(t.Context())
		st, err := e.Submit(ctx, infer.Request{SessionID: "x", Prompt: "cancel me", MaxTokens: 1000, Sampling: infer.Greedy()})
		if err != nil {
			t.Fatal(err)
		}
		qctx, qcancel := context.WithCancel(t.Context())
		queued, err := e.Submit(qctx, infer.Request{Prompt: "queued", MaxTokens: 5, Sampling: infer.Greedy()})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := st.Recv(); err != nil {
			t.Fatal(err)
		}
		qcancel()
		cancel()
		start := time.Now()
		if _, _, err := st.Collect(); !errors.Is(err, infer.ErrCanceled) {
			t.Errorf("canceled request: %v, want ErrCanceled", err)
		}
		if _, _, err := queued.Collect(); !errors.Is(err, infer.ErrCanceled) {
			t.Errorf("canceled while queued: %v, want ErrCanceled", err)
		}
		if took := time.Since(start); took > 50*time.Millisecond {
			t.Errorf("cancellation took %v", took)
		}
		text, _, _ := ask(t, e, "y", "next one", 3)
		if text != answer("next one", 3) {
			t.Errorf("after the cancellations: %q", text)
		}
		if st := e.Stats(); st.Canceled != 2 || st.Running != 0 {
			t.Errorf("stats after: %+v", st)
		}
	})
}

// TestFakeDecodeFailure: a failed decode ends the requests in its batch with the error
// and forgets their conversations (their KV is unknown); the engine goes on serving.
func TestFakeDecodeFailure(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		e, b, stop := startFake(t, nil)
		defer stop()
		ask(t, e, "x", "some words", 2)
		b.mu.Lock()
		b.fail = errors.New("device lost")
		b.mu.Unlock()
		st, err := e.Submit(t.Context(), infer.Request{SessionID: "x", Prompt: "some words t1 more", MaxTokens: 3, Sampling: infer.Greedy()})
		if err != nil {
			t.Fatal(err)
		}
		if _, _, err := st.Collect(); err == nil || !strings.Contains(err.Error(), "device lost") {
			t.Errorf("request in the failed batch: %v", err)
		}
		if _, _, cached := ask(t, e, "x", "some words t1 more", 3); cached != 0 {
			t.Errorf("after a failed decode the conversation kept %d cached tokens", cached)
		}
	})
}

// TestFakeShareDomains: conversations share a prefix's cells only within one sharing
// domain (a tenant, a cache salt): another domain's request with the same beginning
// prefills it all, and moves the shared-tokens counter by nothing.
func TestFakeShareDomains(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		e, _, stop := startFake(t, nil)
		defer stop()
		system := strings.Repeat("the tenant's long system prompt ", 8) // 40 words
		run := func(key, share, prompt string) string {
			text, _, _ := submit(t, e, infer.Request{SessionID: key, Share: share, Prompt: prompt, MaxTokens: 3, Sampling: infer.Greedy()})
			return text
		}
		run("a1", "tenant-a", system+"first")
		before := e.Stats().SharedTokens
		if p := system + "other"; run("b1", "tenant-b", p) != answer(p, 3) {
			t.Error("wrong answer")
		}
		if got := e.Stats().SharedTokens - before; got != 0 {
			t.Errorf("another domain shared %d tokens", got)
		}
		run("a2", "tenant-a", system+"second")
		if got := e.Stats().SharedTokens - before; got != 41 {
			t.Errorf("the same domain shared %d tokens, want 41", got)
		}
	})
}

// TestFakeImportPositions: a frame whose state holds other positions than its tokens say
// (forged, or spliced) is refused, and changes no conversation.
func TestFakeImportPositions(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		e, _, stop := startFake(t, nil)
		defer stop()
		ask(t, e, "keep", "a conversation that must not change", 3)
		frame := func(tokens, stateTokens int) []byte {
			toks := make([]int32, tokens)
			for i := range toks {
				toks[i] = int32(3 + i)
			}
			var state []byte // the fake's: a token a 4 bytes
			for i := range stateTokens {
				state = append(state, byte(3+i), 0, 0, 0)
			}
			head, err := frameHead(frameHeader{Fingerprint: "fake", KVType: e.cfg.KVType, Key: "forged", Tokens: tokens,
				StateBytes: int64(len(state))}, toks, state)
			if err != nil {
				t.Fatal(err)
			}
			return append(head, state...)
		}
		if _, err := e.Import(t.Context(), frame(10, 5), infer.Pushed, ""); !errors.Is(err, infer.ErrFrame) {
			t.Errorf("a frame of 10 tokens with a state of 5: %v, want ErrFrame", err)
		}
		if e.Holds("forged") {
			t.Error("the forged conversation is held")
		}
		if _, err := e.Import(t.Context(), frame(10, 10), infer.Pushed, "another"); !errors.Is(err, infer.ErrFrame) || e.Holds("forged") {
			t.Errorf("a frame of another conversation than the one asked for: %v", err)
		}
		if _, err := e.Import(t.Context(), frame(10, 10), infer.Pushed, "forged"); err != nil {
			t.Errorf("a consistent frame: %v", err)
		}
		if _, _, cached := ask(t, e, "keep", "a conversation that must not change t1 t2 more", 2); cached == 0 {
			t.Error("the other conversation lost its cache")
		}
	})
}

// TestFakePromptBytes: a prompt longer in bytes than the longest prompt could spell is
// refused before it is tokenized; one just within is tokenized and judged by its tokens.
func TestFakePromptBytes(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		e, _, stop := startFake(t, func(c *Config) { c.MaxPromptTokens = 100 })
		defer stop()
		huge := strings.Repeat("x", 100*e.maxPiece+1)
		_, err := e.Submit(t.Context(), infer.Request{Prompt: huge, MaxTokens: 1, Sampling: infer.Greedy()})
		var tooLong *infer.PromptTooLongError
		if !errors.As(err, &tooLong) || tooLong.Bytes != len(huge) {
			t.Errorf("a prompt of %d bytes: %v, want refused by its bytes", len(huge), err)
		}
		words := strings.Repeat("w ", 200) // 400 bytes, 201 tokens
		if _, err := e.Submit(t.Context(), infer.Request{Prompt: words, MaxTokens: 1, Sampling: infer.Greedy()}); !errors.As(err, &tooLong) || tooLong.Tokens != 201 {
			t.Errorf("201 tokens: %v, want refused by its tokens", err)
		}
	})
}

// exportedTurn runs a first turn of conversation key on e and returns its answer and the
// conversation's KV frame.
func exportedTurn(t *testing.T, e *Engine, key, prompt string) (string, []byte) {
	t.Helper()
	first, _, _ := ask(t, e, key, prompt, 2)
	var frame bytes.Buffer
	if _, err := e.Export(t.Context(), key, &frame); err != nil {
		t.Fatal(err)
	}
	return first, frame.Bytes()
}

// TestFakeSource: the first turn after an import reports how its cached tokens came
// (Source); a hand-off of what a replica already held reports the hand-off, a replica never
// hides a hand-off, and once a turn ran here the next reports Local.
func TestFakeSource(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src, _, stopSrc := startFake(t, nil)
		defer stopSrc()
		dst, _, stopDst := startFake(t, nil)
		defer stopDst()
		first, frame := exportedTurn(t, src, "c", "one two three")
		turn := func(prompt string) infer.Origin {
			t.Helper()
			st, err := dst.Submit(t.Context(), infer.Request{SessionID: "c", Prompt: prompt, MaxTokens: 1, Sampling: infer.Greedy()})
			if err != nil {
				t.Fatal(err)
			}
			if _, _, err := st.Collect(); err != nil {
				t.Fatal(err)
			}
			if _, cached, _ := st.Admitted(); cached == 0 {
				t.Fatalf("%q ran cold", prompt)
			}
			return st.Source()
		}
		for _, tc := range []struct {
			imports []infer.Origin
			want    infer.Origin
		}{
			{[]infer.Origin{infer.Replica}, infer.Replica},
			{[]infer.Origin{infer.Replica, infer.HandOff}, infer.HandOff},
			{[]infer.Origin{infer.Pushed, infer.Replica}, infer.Pushed},
			{[]infer.Origin{infer.Pulled}, infer.Pulled},
		} {
			for _, o := range tc.imports {
				if _, err := dst.Import(t.Context(), frame, o, ""); err != nil {
					t.Fatal(err)
				}
			}
			if got := turn("one two three" + first + " four"); got != tc.want {
				t.Errorf("imported as %v: the next turn reports %q, want %q", tc.imports, got, tc.want)
			}
			if got := turn("one two three" + first + " four five"); got != infer.Local {
				t.Errorf("imported as %v: the turn after reports %q, want local", tc.imports, got)
			}
		}
	})
}

// TestFakeOwns: a conversation imported as a replica is held but not owned; a push of it,
// or a turn run here, makes it this node's own; demoted, it is a replica again.
func TestFakeOwns(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src, _, stopSrc := startFake(t, nil)
		defer stopSrc()
		dst, _, stopDst := startFake(t, nil)
		defer stopDst()
		first, frame := exportedTurn(t, src, "c", "one two three")
		state := func(when string, holds, owns bool) {
			t.Helper()
			if dst.Holds("c") != holds || dst.Owns("c") != owns {
				t.Errorf("%s: holds %v, owns %v; want %v, %v", when, dst.Holds("c"), dst.Owns("c"), holds, owns)
			}
		}
		state("before any import", false, false)
		if _, err := dst.Import(t.Context(), frame, infer.Replica, ""); err != nil {
			t.Fatal(err)
		}
		state("imported as a replica", true, false)
		if _, err := dst.Import(t.Context(), frame, infer.Pushed, ""); err != nil {
			t.Fatal(err)
		}
		state("then pushed", true, true)
		if err := dst.Demote(t.Context(), "c"); err != nil {
			t.Fatal(err)
		}
		state("demoted", true, false)
		ask(t, dst, "c", "one two three"+first+" four", 1)
		state("after a turn here", true, true)
	})
}

// TestFakePromptLogprobs: a prompt given as tokens is scored whole, a step at a time,
// even when its conversation holds its beginning: each token after the first gets the
// model's log probability of it (the fake's is high where the token is the one it
// predicts, low elsewhere) and its most likely alternative; prefill-only generates nothing.
func TestFakePromptLogprobs(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		e, b, stop := startFake(t, nil)
		defer stop()
		const n, wrong = 3*maxScoredPerStep + 5, 100
		prompt := []int32{fakeBOS}
		for pos := 1; pos < n; pos++ {
			next := nextToken(prompt[pos-1], pos-1)
			if pos == wrong {
				next = 3 + (next-3+1)%(fakeVocab-3) // not the predicted token
			}
			prompt = append(prompt, next)
		}
		// The conversation's first turn caches the prompt's beginning.
		submit(t, e, infer.Request{SessionID: "c", Prompt: "scored", Tokens: prompt[:50], MaxTokens: 1, Sampling: infer.Greedy()})
		_, res, cached := submit(t, e, infer.Request{SessionID: "c", Prompt: "scored", Tokens: prompt, PromptLogprobs: true,
			TopLogprobs: 1, PrefillOnly: true, Sampling: infer.Greedy()})
		if cached != 0 || res.CompletionTokens != 0 || res.FinishReason != "length" || len(res.PromptLogprobs) != n {
			t.Fatalf("cached %d, %d generated (%q), %d prompt logprobs; want 0, 0 (length), %d", cached, res.CompletionTokens,
				res.FinishReason, len(res.PromptLogprobs), n)
		}
		lse := math.Log(math.E + fakeVocab - 1) // the fake's row: 1 at its prediction, 0 elsewhere
		for i, lp := range res.PromptLogprobs {
			want := 1 - lse
			switch i {
			case 0:
				want = 0
			case wrong:
				want = -lse
			}
			if lp.Token != fmt.Sprintf(" t%d", prompt[i]) || math.Abs(float64(lp.Logprob)-want) > 1e-5 {
				t.Fatalf("token %d: %q %v, want %q %v", i, lp.Token, lp.Logprob, fmt.Sprintf(" t%d", prompt[i]), want)
			}
		}
		if b.maxRows > maxScoredPerStep {
			t.Errorf("a step kept %d rows of logits, more than %d", b.maxRows, maxScoredPerStep)
		}
		if top := res.PromptLogprobs[wrong].Top; len(top) != 1 || top[0].Token != fmt.Sprintf(" t%d", nextToken(prompt[wrong-1], wrong-1)) {
			t.Errorf("the wrong token's alternative: %+v", top)
		}
		// A token outside the vocabulary is refused.
		if _, err := e.Submit(t.Context(), infer.Request{Prompt: "x", Tokens: []int32{fakeVocab}, Sampling: infer.Greedy()}); !errors.Is(err, infer.ErrInvalid) {
			t.Errorf("a token outside the vocabulary: %v", err)
		}
	})
}

// TestFakeBatchPriority: batch work yields to interactive work. With three batch streams
// decoding, an interactive prompt's first token comes within 1.5x of its time on an idle
// engine (batch decoding pauses while it is prefilled), sooner than behind three
// interactive streams; a batch request is not admitted into the last free sequence, and
// the queue refuses batch work at half its length while it still takes interactive work.
func TestFakeBatchPriority(t *testing.T) {
	probe := strings.TrimSpace(strings.Repeat("w ", 120))
	ttft := func(background int, batch bool) time.Duration {
		var got time.Duration
		synctest.Test(t, func(t *testing.T) {
			e, _, stop := startFake(t, func(c *Config) { c.Sequences, c.Cells = 5, 4096 })
			defer stop()
			var streams []*Stream
			for i := range background {
				st, err := e.Submit(t.Context(), infer.Request{SessionID: fmt.Sprint("bg", i), Prompt: fmt.Sprint("background ", i),
					MaxTokens: 400, Batch: batch, Sampling: infer.Greedy()})
				if err != nil {
					t.Fatal(err)
				}
				streams = append(streams, st)
			}
			for _, st := range streams { // all decoding
				if _, err := st.Recv(); err != nil {
					t.Fatal(err)
				}
			}
			start := time.Now()
			st, err := e.Submit(t.Context(), infer.Request{SessionID: "probe", Prompt: probe, MaxTokens: 1, Sampling: infer.Greedy()})
			if err != nil {
				t.Fatal(err)
			}
			st.Recv()
			got = time.Since(start)
			for _, s := range streams {
				s.Collect()
			}
		})
		return got
	}
	idle, behindBatch, behindInteractive := ttft(0, false), ttft(3, true), ttft(3, false)
	t.Logf("first token of a 120-token prompt: idle %v, beside 3 batch streams %v, beside 3 interactive streams %v", idle, behindBatch, behindInteractive)
	if behindBatch > idle*3/2 || behindBatch >= behindInteractive {
		t.Errorf("beside batch streams the interactive first token took %v (idle %v, beside interactive streams %v)", behindBatch, idle, behindInteractive)
	}

	synctest.Test(t, func(t *testing.T) {
		e, _, stop := startFake(t, func(c *Config) { c.Sequences, c.MaxQueue = 3, 4 })
		defer stop()
		submit := func(key string, batch bool) (*Stream, error) {
			return e.Submit(t.Context(), infer.Request{SessionID: key, Prompt: "hello " + key, MaxTokens: 300, Batch: batch, Sampling: infer.Greedy()})
		}
		var running []*Stream
		for _, k := range []string{"b1", "b2", "b3", "b4"} {
			st, err := submit(k, true)
			if err != nil {
				t.Fatal(err)
			}
			running = append(running, st)
			time.Sleep(5 * time.Millisecond) // a step: admitted, if it may be
		}
		if st := e.Stats(); st.Running != 2 || st.Waiting != 2 {
			t.Fatalf("4 batch requests on 3 sequences: %d running, %d waiting; want 2 and 2 (a sequence kept for interactive work)", st.Running, st.Waiting)
		}
		if _, err := submit("b5", true); !errors.Is(err, infer.ErrOverloaded) {
			t.Errorf("a batch request with the queue half full: %v, want refused", err)
		}
		i1, err := submit("i1", false)
		if err != nil {
			t.Fatalf("an interactive request with the queue half full: %v", err)
		}
		if _, err := i1.Recv(); err != nil {
			t.Fatal(err)
		}
		if _, _, ok := running[2].Admitted(); ok {
			t.Error("the waiting batch request was admitted before the interactive one")
		}
		for _, st := range append(running, i1) {
			st.Collect()
		}
	})
}

// TestFakePreemption: an interactive request that finds every sequence running preempts a
// batch request rather than wait for it. The batch request's KV is copied out (the fake
// refuses a token at a position its sequence does not reach, so a resume without it
// fails), and it resumes when batch work may run again: its answer is the one it gives
// alone. A parked request's client can still cancel it.
func TestFakePreemption(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		e, _, stop := startFake(t, func(c *Config) { c.Sequences = 2 })
		defer stop()
		submit := func(ctx context.Context, key string, n int, batch bool) *Stream {
			st, err := e.Submit(ctx, infer.Request{SessionID: key, Prompt: "hello " + key, MaxTokens: n, Batch: batch, Sampling: infer.Greedy()})
			if err != nil {
				t.Fatal(err)
			}
			return st
		}
		first := func(st *Stream) string {
			text, err := st.Recv()
			if err != nil {
				t.Fatal(err)
			}
			return text
		}
		b := submit(t.Context(), "b", 300, true)
		bText := first(b)
		i1 := submit(t.Context(), "i1", 200, false) // the sequence kept free for interactive work
		first(i1)
		i2 := submit(t.Context(), "i2", 5, false) // none free: b is preempted
		first(i2)
		if st := statsUntil(e, func(s infer.Stats) bool { return s.Parked > 0 }); st.Preemptions != 1 || st.Parked != 1 || st.Waiting != 1 {
			t.Errorf("an interactive request with every sequence running: %d preempted, %d parked, %d waiting; want 1, 1, 1",
				st.Preemptions, st.Parked, st.Waiting)
		}
		for _, st := range []*Stream{i2, i1} {
			if _, _, err := st.Collect(); err != nil {
				t.Fatal(err)
			}
		}
		rest, res, err := b.Collect()
		if err != nil {
			t.Fatalf("the preempted request: %v", err)
		}
		if got, want := bText+rest, answer("hello b", 300); got != want || res.CompletionTokens != 300 {
			t.Errorf("the preempted request's answer (%d tokens) differs from its answer alone:\n got %q\nwant %q", res.CompletionTokens, got, want)
		}
		if st := e.Stats(); st.Parked != 0 || st.Running != 0 {
			t.Errorf("after: %d parked, %d running", st.Parked, st.Running)
		}

		// Parked, then canceled by its client: it ends with ErrCanceled, at once.
		ctx, cancel := context.WithCancel(t.Context())
		b = submit(ctx, "b2", 300, true)
		first(b)
		i1 = submit(t.Context(), "i3", 200, false)
		first(i1)
		i2 = submit(t.Context(), "i4", 200, false)
		first(i2)
		if st := statsUntil(e, func(s infer.Stats) bool { return s.Parked > 0 }); st.Parked != 1 {
			t.Fatalf("%d parked, want 1", st.Parked)
		}
		cancel()
		if _, _, err := b.Collect(); !errors.Is(err, infer.ErrCanceled) {
			t.Errorf("a parked request canceled: %v, want ErrCanceled", err)
		}
		if st := statsUntil(e, func(s infer.Stats) bool { return s.Parked == 0 }); st.Parked != 0 || st.Running != 2 {
			t.Errorf("after the cancel: %d parked, %d running; want 0, 2", st.Parked, st.Running)
		}
		i1.Collect()
		i2.Collect()
	})
}

// statsUntil polls the engine's stats (published after each step) until cond holds, for
// at most a second of the bubble's virtual time, and returns the last.
func statsUntil(e *Engine, cond func(infer.Stats) bool) infer.Stats {
	for deadline := time.Now().Add(time.Second); ; time.Sleep(time.Millisecond) {
		if st := e.Stats(); cond(st) || !time.Now().Before(deadline) {
			return st
		}
	}
}

// TestFakeHostKV: an idle conversation beside a decoding stream has its cells moved out
// of the pool to host memory after stashAfter steps (Config.HostKV), its KV frame
// unchanged; its next turn finds its history cached all the same, and another conversation
// still shares its beginning. Host memory holds at most Cells tokens; without HostKV, or
// without a unified pool, nothing moves.
func TestFakeHostKV(t *testing.T) {
	system := strings.Repeat("you answer about rivers ", 10) // 40 words
	first := system + "the river runs to the sea"
	background := func(t *testing.T, e *Engine, n int) *Stream {
		st, err := e.Submit(t.Context(), infer.Request{SessionID: "bg", Prompt: "keep on going", MaxTokens: n, Sampling: infer.Greedy()})
		if err != nil {
			t.Fatal(err)
		}
		return st
	}
	t.Run("moved and back", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			e, _, stop := startFake(t, nil)
			defer stop()
			text, _, _ := ask(t, e, "conv", first, 4)
			var before bytes.Buffer
			held, err := e.Export(t.Context(), "conv", &before)
			if err != nil {
				t.Fatal(err)
			}
			bg := background(t, e, 50)
			st := statsUntil(e, func(s infer.Stats) bool { return s.HostTokens > 0 })
			if st.HostMoves != 1 || st.HostTokens != held || st.Conversations != 1 || !e.Holds("conv") {
				t.Errorf("beside a stream: %d moved, %d tokens in host memory, %d conversations, held %v; want 1, %d, 1, true",
					st.HostMoves, st.HostTokens, st.Conversations, e.Holds("conv"), held)
			}
			if st.KVUsed != st.KVActive {
				t.Errorf("%d cells used, %d of them running: the idle conversation's are still in the pool", st.KVUsed, st.KVActive)
			}
			var after bytes.Buffer
			if _, err := e.Export(t.Context(), "conv", &after); err != nil || !bytes.Equal(before.Bytes(), after.Bytes()) {
				t.Errorf("the frame from host memory differs from the pool's (err %v)", err)
			}
			next := first + text + " and then"
			text2, _, cached := ask(t, e, "conv", next, 4)
			if cached != held || text2 != answer(next, 4) {
				t.Errorf("next turn: %d cached, %q; want %d, %q", cached, text2, held, answer(next, 4))
			}
			if st := e.Stats(); st.HostTokens != 0 {
				t.Errorf("%d tokens still in host memory after the next turn", st.HostTokens)
			}
			if _, _, err := bg.Collect(); err != nil {
				t.Fatal(err)
			}
		})
	})
	t.Run("shared from host memory", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			e, _, stop := startFake(t, nil)
			defer stop()
			ask(t, e, "a", first, 3)
			bg := background(t, e, 50)
			statsUntil(e, func(s infer.Stats) bool { return s.HostTokens > 0 })
			p := system + "second question here"
			text, _, _ := ask(t, e, "b", p, 3)
			if st := e.Stats(); st.SharedTokens != 1+40 || text != answer(p, 3) {
				t.Errorf("a beginning held in host memory: %d tokens shared, %q; want 41, %q", st.SharedTokens, text, answer(p, 3))
			}
			bg.Collect()
		})
	})
	t.Run("bounded", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			e, _, stop := startFake(t, func(c *Config) { c.Cells = 136 })
			defer stop()
			ask(t, e, "a", first, 3) // 49 tokens each
			ask(t, e, "b", strings.Replace(first, "rivers", "lakes", 1), 3)
			bg := background(t, e, 30)
			st := statsUntil(e, func(s infer.Stats) bool { return s.HostTokens > 0 })
			bg.Collect()
			if st = e.Stats(); st.HostMoves != 2 || st.HostTokens != 2*49 {
				t.Errorf("%d moved, %d tokens in host memory; want 2, 98", st.HostMoves, st.HostTokens)
			}
			ask(t, e, "c", strings.Replace(first, "rivers", "seas", 1), 3)
			bg = background(t, e, 30)
			bg.Collect()
			if st = e.Stats(); st.HostTokens > 136 || st.HostMoves != 2 {
				t.Errorf("%d moved, %d tokens in host memory; want 2 and at most the pool's 136", st.HostMoves, st.HostTokens)
			}
		})
	})
	for _, c := range []struct {
		name string
		edit func(*Config)
	}{
		{"off", func(c *Config) { c.HostKV = false }},
		{"partitioned", func(c *Config) { c.UnifiedKV = false }},
	} {
		t.Run(c.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				e, _, stop := startFake(t, c.edit)
				defer stop()
				ask(t, e, "conv", first, 4)
				background(t, e, 50).Collect()
				if st := e.Stats(); st.HostMoves != 0 {
					t.Errorf("%d moved to host memory", st.HostMoves)
				}
			})
		})
	}
}

// TestFakePartitions: without a unified pool, more conversations than partitions take
// turns in them: a conversation that needs a partition when none is free moves the least
// recently used idle one's cells to host memory (its frame unchanged, its next turn
// cached), or drops it when host memory has no room or HostKV is off.
func TestFakePartitions(t *testing.T) {
	prompts := map[string]string{
		"a": strings.Repeat("first conversation words ", 8),
		"b": strings.Repeat("second conversation here ", 8),
		"c": strings.Repeat("third one talks on ", 8),
	}
	partitioned := func(host bool, hostCells int) func(*Config) {
		return func(c *Config) { c.UnifiedKV, c.Sequences, c.HostKV, c.HostCells = false, 2, host, hostCells }
	}
	t.Run("moved to host memory", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			e, _, stop := startFake(t, partitioned(true, 0))
			defer stop()
			texts := map[string]string{}
			for _, k := range []string{"a", "b"} {
				texts[k], _, _ = ask(t, e, k, prompts[k], 4)
			}
			var before bytes.Buffer
			held, err := e.Export(t.Context(), "a", &before)
			if err != nil {
				t.Fatal(err)
			}
			texts["c"], _, _ = ask(t, e, "c", prompts["c"], 4) // both partitions are held: a's moves out
			st := e.Stats()
			if st.HostMoves != 1 || st.HostTokens != held || st.Evictions != 0 || st.Conversations != 3 || !e.Holds("a") {
				t.Errorf("a third conversation in two partitions: %d moved, %d tokens in host memory, %d evicted, %d held, a held %v; want 1, %d, 0, 3, true",
					st.HostMoves, st.HostTokens, st.Evictions, st.Conversations, e.Holds("a"), held)
			}
			var after bytes.Buffer
			if _, err := e.Export(t.Context(), "a", &after); err != nil || !bytes.Equal(before.Bytes(), after.Bytes()) {
				t.Errorf("a's frame from host memory differs from its partition's (err %v)", err)
			}
			next := prompts["a"] + texts["a"] + " and then"
			text, _, cached := ask(t, e, "a", next, 4) // b's partition is the least recently used
			if cached != held || text != answer(next, 4) {
				t.Errorf("a's next turn: %d cached, %q; want %d, %q", cached, text, held, answer(next, 4))
			}
			if st := e.Stats(); st.HostMoves != 2 || st.Evictions != 0 || st.Conversations != 3 {
				t.Errorf("after a's next turn: %d moved, %d evicted, %d held; want 2, 0, 3", st.HostMoves, st.Evictions, st.Conversations)
			}
			// Two at once: both partitions run, and every conversation stays held.
			var streams []*Stream
			for _, k := range []string{"b", "c"} {
				st, err := e.Submit(t.Context(), infer.Request{SessionID: k, Prompt: prompts[k] + texts[k] + " more", MaxTokens: 4, Sampling: infer.Greedy()})
				if err != nil {
					t.Fatal(err)
				}
				streams = append(streams, st)
			}
			for i, k := range []string{"b", "c"} {
				got, _, err := streams[i].Collect()
				if p := prompts[k] + texts[k] + " more"; err != nil || got != answer(p, 4) {
					t.Errorf("%s beside another: %q, %v; want %q", k, got, err, answer(p, 4))
				}
				if _, cached, _ := streams[i].Admitted(); cached == 0 {
					t.Errorf("%s found nothing cached", k)
				}
			}
			if st := e.Stats(); st.Conversations != 3 || st.Evictions != 0 {
				t.Errorf("%d held, %d evicted; want 3, 0", st.Conversations, st.Evictions)
			}
		})
	})
	t.Run("packed", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			e, b, stop := startFake(t, func(c *Config) { c.UnifiedKV, c.Sequences = false, 4 })
			defer stop()
			own := map[string]string{}
			for _, k := range []string{"a", "b", "c", "d"} { // in partitions 0-3
				own[k] = strings.Repeat("words of "+k+" ", 8)
				ask(t, e, k, own[k], 4)
			}
			beside := func(long, short string) {
				t.Helper()
				st, err := e.Submit(t.Context(), infer.Request{SessionID: long, Prompt: own[long] + " go on", MaxTokens: 40, Sampling: infer.Greedy()})
				if err != nil {
					t.Fatal(err)
				}
				if text, _, _ := ask(t, e, short, own[short]+" and", 8); text != answer(own[short]+" and", 8) {
					t.Errorf("%s beside %s: %q", short, long, text)
				}
				if _, _, err := st.Collect(); err != nil {
					t.Fatal(err)
				}
			}
			beside("b", "a") // admitted after b, a decodes in a lower partition: in id order, one pass
			beside("a", "d") // d's partition is not next to a's: d moves next to it
			if b.scattered != 0 {
				t.Errorf("%d steps of one token a sequence took more than one pass over the weights", b.scattered)
			}
			if st := e.Stats(); st.HostMoves == 0 || st.Evictions != 0 {
				t.Errorf("%d moved to host memory, %d evicted; want some, 0", st.HostMoves, st.Evictions)
			}
		})
	})
	t.Run("import while every partition runs", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			// A longer copy of a, from an engine where it ran a second turn.
			from, _, stopFrom := startFake(t, nil)
			defer stopFrom()
			first, _, _ := ask(t, from, "a", prompts["a"], 4)
			ask(t, from, "a", prompts["a"]+first+" and then", 4)
			var frame bytes.Buffer
			if _, err := from.Export(t.Context(), "a", &frame); err != nil {
				t.Fatal(err)
			}
			e, _, stop := startFake(t, partitioned(true, 0))
			defer stop()
			texts := map[string]string{}
			for _, k := range []string{"a", "b", "c"} { // a's moves out to host memory
				texts[k], _, _ = ask(t, e, k, prompts[k], 4)
			}
			held := e.Stats().HostTokens
			var streams []*Stream
			for _, k := range []string{"b", "c"} {
				st, err := e.Submit(t.Context(), infer.Request{SessionID: k, Prompt: prompts[k] + texts[k] + " more", MaxTokens: 40, Sampling: infer.Greedy()})
				if err != nil {
					t.Fatal(err)
				}
				if _, err := st.Recv(); err != nil { // running
					t.Fatal(err)
				}
				streams = append(streams, st)
			}
			if _, err := e.Import(t.Context(), frame.Bytes(), infer.Pushed, ""); !errors.Is(err, infer.ErrOverloaded) {
				t.Errorf("an import while both partitions run: %v, want ErrOverloaded", err)
			}
			if st := e.Stats(); !e.Holds("a") || st.HostTokens != held {
				t.Errorf("the refused import changed a's copy: held %v, %d tokens in host memory; want true, %d", e.Holds("a"), st.HostTokens, held)
			}
			for _, st := range streams {
				if _, _, err := st.Collect(); err != nil {
					t.Fatal(err)
				}
			}
		})
	})
	for _, c := range []struct {
		name      string
		host      bool
		hostCells int
	}{
		{"host memory full", true, 8},
		{"off", false, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				e, _, stop := startFake(t, partitioned(c.host, c.hostCells))
				defer stop()
				for _, k := range []string{"a", "b", "c"} {
					ask(t, e, k, prompts[k], 4)
				}
				if st := e.Stats(); st.HostMoves != 0 || st.Evictions != 1 || st.Conversations != 2 || e.Holds("a") {
					t.Errorf("%d moved, %d evicted, %d held, a held %v; want 0, 1, 2, false", st.HostMoves, st.Evictions, st.Conversations, e.Holds("a"))
				}
			})
		})
	}
}

// TestHostSpares: restored conversations' buffers are kept for the next move out while
// they and the states in host memory fit in the host bound, the oldest dropped first,
// and a move out takes the smallest one with room.
func TestHostSpares(t *testing.T) {
	e := &Engine{hostCells: 100, cellBytes: 4, hostBytes: 200} // room for 400 bytes, 200 held
	e.keepSpare(make([]byte, 120))
	e.keepSpare(make([]byte, 40))
	e.keepSpare(make([]byte, 80)) // 440 bytes: the 120 go
	if e.spareBytes != 120 || len(e.spare) != 2 {
		t.Fatalf("%d buffers of %d bytes kept beside 200 held; want 2 of 120 (the bound is 400)", len(e.spare), e.spareBytes)
	}
	for _, c := range []struct{ need, want int }{{10, 40}, {50, 80}, {50, 0}} {
		if got := cap(e.takeSpare(c.need)); got != c.want {
			t.Errorf("for %d bytes: a buffer of %d; want %d", c.need, got, c.want)
		}
	}
	if e.spareBytes != 0 || len(e.spare) != 0 {
		t.Errorf("%d buffers of %d bytes left; want none", len(e.spare), e.spareBytes)
	}
}

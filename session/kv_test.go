package session

import (
	"bytes"
	"errors"
	"os"
	"slices"
	"testing"

	"github.com/infernode/infernode/internal/testenv"
	"github.com/infernode/infernode/session/infer"
	"github.com/infernode/infernode/session/llama"
)

// A conversation exported from one engine and imported into another continues there
// exactly as an uninterrupted run would, from its cache.
func TestKVMove(t *testing.T) {
	for _, tc := range []struct {
		name, model, reference string
	}{
		{"stories260K", "stories260K.gguf", testenv.Stories260KOnceUponATime},
		{"test model", "", ""},
		// Random weights in SmolLM2-135M's shapes (make bench-model): a realistic state
		// size, 30 layers of KV.
		{"realistic shape", "bench", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := testenv.Model(t)
			switch tc.model {
			case "":
			case "bench":
				if path = os.Getenv("INFERNODE_BENCH_MODEL"); path == "" {
					t.Skip("INFERNODE_BENCH_MODEL not set (make test sets it to the model make bench-model writes)")
				}
			default:
				path = testenv.SharedModel(t, tc.model)
			}
			model := func(c *Config) { c.ModelPath = path }
			src, dst, whole := startEngine(t, model), startEngine(t, model), startEngine(t, model)
			const prompt = "Once upon a time"

			first, _ := generate(t, src, greedy("k", prompt, 60))
			if tc.reference != "" && first != tc.reference {
				t.Fatalf("first turn %q, want the reference %q", first, tc.reference)
			}
			uninterrupted, _ := generate(t, whole, greedy("", prompt, 100))

			var frame bytes.Buffer
			n, err := src.Export(t.Context(), "k", &frame)
			if err != nil {
				t.Fatal(err)
			}
			res, err := dst.Import(t.Context(), frame.Bytes(), infer.Pushed, "")
			if err != nil {
				t.Fatal(err)
			}
			if keys, _ := dst.Conversations(t.Context()); res.Key != "k" || res.Tokens != n || !slices.Equal(keys, []string{"k"}) {
				t.Fatalf("imported %+v (exported %d tokens); conversations cached %q", res, n, keys)
			}
			t.Logf("%d tokens, %d bytes of state, %d bytes of frame, installed in %v", n, res.Bytes, frame.Len(), res.Stall)

			rest, r := generate(t, dst, greedy("k", prompt+first, 40))
			if r.CachedTokens < n-1 {
				t.Errorf("the next turn found %d of its %d prompt tokens cached, want the %d imported (less the last)", r.CachedTokens, r.PromptTokens, n)
			}
			if first+rest != uninterrupted {
				t.Errorf("after the move:\n%q\nuninterrupted:\n%q", first+rest, uninterrupted)
			}
		})
	}
}

// Frames another engine cannot use are refused with ErrFrame and change nothing.
func TestKVImportRefusals(t *testing.T) {
	src := startEngine(t, nil)
	generate(t, src, greedy("k", "the sea is", 20))
	var frame bytes.Buffer
	if _, err := src.Export(t.Context(), "k", &frame); err != nil {
		t.Fatal(err)
	}
	good := frame.Bytes()
	flipped := bytes.Clone(good)
	flipped[len(flipped)-10] ^= 0xff
	otherKV := startEngine(t, func(c *Config) { c.KVType = "q8_0" })
	dst := startEngine(t, nil)
	held, _ := generate(t, dst, greedy("mine", "the river", 8))
	for _, tc := range []struct {
		name   string
		engine *Engine
		frame  []byte
	}{
		{"another KV type", otherKV, good},
		{"truncated in the state", dst, good[:len(good)-100]},
		{"truncated in the header", dst, good[:20]},
		{"a flipped byte", dst, flipped},
		{"not a frame", dst, []byte("hello, this is not a KV frame at all")},
	} {
		_, err := tc.engine.Import(t.Context(), tc.frame, infer.Pushed, "")
		if !errors.Is(err, infer.ErrFrame) {
			t.Errorf("%s: Import = %v, want infer.ErrFrame", tc.name, err)
		}
		t.Logf("%s: %v", tc.name, err)
	}
	// Asked of the engine's loop: Stats is a snapshot it publishes after its work, which
	// may not yet count the conversation the stream just ended (CI saw 0 once).
	if keys, err := dst.Conversations(t.Context()); err != nil || !slices.Equal(keys, []string{"mine"}) {
		t.Errorf("after refused imports: conversations cached %q (%v), want only the one held before", keys, err)
	}
	again, r := generate(t, dst, greedy("mine", "the river"+held, 4))
	if r.CachedTokens == 0 || again == "" {
		t.Errorf("the conversation held before lost its cache: %d cached tokens", r.CachedTokens)
	}
	if _, err := src.Export(t.Context(), "nobody", &frame); !errors.Is(err, infer.ErrNotCached) {
		t.Errorf("Export of an unknown conversation = %v, want infer.ErrNotCached", err)
	}
}

// TestBackendFlashAttn: the engine's context computes attention as Config.FlashAttn says
// (a state of its cells goes into a llama.cpp context of the same setting, which with the
// other V layout it would not: TestFlashAttnLayout).
func TestBackendFlashAttn(t *testing.T) {
	for _, flash := range []bool{true, false} {
		cfg := DefaultConfig()
		cfg.ModelPath, cfg.Cells, cfg.Sequences, cfg.BatchSize, cfg.Threads, cfg.FlashAttn = testenv.Model(t), 256, 1, 64, 1, flash
		b, err := loadLlama(cfg)
		if err != nil {
			t.Fatal(err)
		}
		defer b.Close()
		b.batch.Clear()
		for i := range 16 {
			b.batch.Add(int32(i+1), i, 0, i == 15)
		}
		if err := b.ctx.Decode(b.batch); err != nil {
			t.Fatal(err)
		}
		state, err := b.ctx.SeqState(0, nil)
		if err != nil {
			t.Fatal(err)
		}
		c, err := llama.NewContext(b.model, llama.ContextParams{Cells: 256, Sequences: 1, Batch: 64, Threads: 1, Unified: true, FlashAttn: flash})
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if err := c.SetSeqState(0, state); err != nil {
			t.Errorf("FlashAttn %v: the engine's state does not go into a llama.cpp context with flash attention %v: %v", flash, flash, err)
		}
	}
}

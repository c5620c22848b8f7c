// Command mkmodel writes the GGUF models infernode's tests, benchmarks and `make run` use.
//
// No model can be downloaded where infernode is built and tested, so the project makes its
// own. Two shapes are built in:
//
//   - tiny: a small llama-architecture model (4 layers, 128-wide) with a word vocabulary,
//     byte fallback and a ChatML chat template. llama.cpp loads it, tokenizes and
//     detokenizes text with it and generates words. Its weights are random (from -seed), so
//     what it says is grammatical nonsense: it is a test model, not a language model.
//   - smollm2-135m: the same vocabulary padded to 49,152 tokens, in the tensor shapes of
//     SmolLM2-135M (30 layers, 576-wide, 9 query and 3 KV heads). Random weights, but every
//     step costs what the real model costs, so benchmarks on it mean something.
//
// The output is deterministic: the same flags always write the same bytes.
package main

import (
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"hash/fnv"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/ollama/ollama/fs/ggml"
	"github.com/x448/float16"
)

// shape is a llama-architecture model's hyperparameters.
type shape struct {
	name    string
	embd    int // hidden size
	layers  int
	heads   int
	headsKV int
	ff      int // feed-forward width
	vocab   int // tokens; the word vocabulary is padded with unused tokens up to this
	ctx     int // trained context length written to the GGUF
	ropeTh  float32
	kind    string // default weight type
}

var shapes = map[string]shape{
	"tiny":         {name: "infernode-tiny", embd: 128, layers: 4, heads: 4, headsKV: 2, ff: 256, ctx: 8192, ropeTh: 10000, kind: "f32"},
	"smollm2-135m": {name: "infernode-smollm2-135m-shape", embd: 576, layers: 30, heads: 9, headsKV: 3, ff: 1536, vocab: 49152, ctx: 8192, ropeTh: 100000, kind: "f16"},
}

// chatML is the chat template written into every model. llama.cpp recognises it as
// "chatml" by its <|im_start|> marker.
const chatML = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"

func main() {
	out := flag.String("out", "models/infernode-tiny.gguf", "path of the GGUF file to write")
	shapeName := flag.String("shape", "tiny", "model shape: tiny or smollm2-135m")
	kind := flag.String("type", "", "weight type: f32 or f16 (default: the shape's own)")
	seed := flag.Uint64("seed", 1, "seed of the random weights")
	flag.Parse()

	s, ok := shapes[*shapeName]
	if !ok {
		fmt.Fprintf(os.Stderr, "mkmodel: unknown shape %q (want tiny or smollm2-135m)\n", *shapeName)
		os.Exit(2)
	}
	if *kind != "" {
		s.kind = *kind
	}
	if err := write(*out, s, *seed); err != nil {
		fmt.Fprintf(os.Stderr, "mkmodel: %v\n", err)
		os.Exit(1)
	}
}

// write builds the model in a temporary file beside path and renames it into place, so a
// reader never sees half a model.
func write(path string, s shape, seed uint64) error {
	kindID, ok := map[string]uint32{"f32": 0, "f16": 1}[s.kind]
	if !ok {
		return fmt.Errorf("unknown weight type %q (want f32 or f16)", s.kind)
	}
	v := buildVocab(s.vocab)
	kv := ggml.KV{
		"general.architecture":                   "llama",
		"general.name":                           s.name,
		"general.file_type":                      kindID,
		"llama.context_length":                   uint32(s.ctx),
		"llama.embedding_length":                 uint32(s.embd),
		"llama.block_count":                      uint32(s.layers),
		"llama.feed_forward_length":              uint32(s.ff),
		"llama.attention.head_count":             uint32(s.heads),
		"llama.attention.head_count_kv":          uint32(s.headsKV),
		"llama.attention.layer_norm_rms_epsilon": float32(1e-5),
		"llama.rope.freq_base":                   s.ropeTh,
		"llama.rope.dimension_count":             uint32(s.embd / s.heads),
		"llama.vocab_size":                       uint32(len(v.tokens)),
		"tokenizer.ggml.model":                   "llama",
		"tokenizer.ggml.tokens":                  v.tokens,
		"tokenizer.ggml.scores":                  v.scores,
		"tokenizer.ggml.token_type":              v.types,
		"tokenizer.ggml.unknown_token_id":        uint32(tokUnk),
		"tokenizer.ggml.bos_token_id":            uint32(tokBOS),
		"tokenizer.ggml.eos_token_id":            uint32(tokIMEnd),
		"tokenizer.ggml.add_bos_token":           true,
		"tokenizer.ggml.add_eos_token":           false,
		"tokenizer.chat_template":                chatML,
	}

	kvDim := s.embd / s.heads * s.headsKV
	dims := func(d ...int) []uint64 {
		out := make([]uint64, len(d))
		for i, x := range d {
			out[i] = uint64(x)
		}
		return out
	}
	var ts []*ggml.Tensor
	prog := &progress{path: path}
	add := func(name string, k uint32, fill filler, d ...int) {
		t := tensorData{name: name, kind: k, n: product(d), seed: seed, fill: fill, progress: prog}
		prog.total += int64(t.n * t.size())
		ts = append(ts, &ggml.Tensor{Name: name, Kind: k, Shape: dims(d...), WriterTo: t})
	}
	// Linear layers get the usual 1/sqrt(fan-in) scale; norms are ones. The output head
	// is random only for whole words and punctuation, so the model generates words.
	linear := func(fanIn int) filler {
		std := float32(1 / math.Sqrt(float64(fanIn)))
		return func(_ int, r *rand.Rand) float32 { return float32(r.NormFloat64()) * std }
	}
	ones := func(int, *rand.Rand) float32 { return 1 }
	add("token_embd.weight", kindID, linear(1), s.embd, len(v.tokens))
	add("output_norm.weight", 0, ones, s.embd)
	outScale := 4 / float32(math.Sqrt(float64(s.embd)))
	add("output.weight", kindID, func(i int, r *rand.Rand) float32 {
		x := float32(r.NormFloat64()) * outScale
		if !v.output[i/s.embd] {
			return 0
		}
		return x
	}, s.embd, len(v.tokens))
	for l := range s.layers {
		p := fmt.Sprintf("blk.%d.", l)
		add(p+"attn_norm.weight", 0, ones, s.embd)
		add(p+"attn_q.weight", kindID, linear(s.embd), s.embd, s.embd)
		add(p+"attn_k.weight", kindID, linear(s.embd), s.embd, kvDim)
		add(p+"attn_v.weight", kindID, linear(s.embd), s.embd, kvDim)
		add(p+"attn_output.weight", kindID, linear(s.embd), s.embd, s.embd)
		add(p+"ffn_norm.weight", 0, ones, s.embd)
		add(p+"ffn_gate.weight", kindID, linear(s.embd), s.embd, s.ff)
		add(p+"ffn_up.weight", kindID, linear(s.embd), s.embd, s.ff)
		add(p+"ffn_down.weight", kindID, linear(s.ff), s.ff, s.embd)
	}

	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	prog.start()
	tmp, err := os.CreateTemp(filepath.Dir(path), ".mkmodel-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if err := ggml.WriteGGUF(tmp, kv, ts); err != nil {
		tmp.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := tmp.Chmod(0o644); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}

func product(d []int) int {
	n := 1
	for _, x := range d {
		n *= x
	}
	return n
}

// Special token ids. SPM models conventionally put unk, bos and eos first; the ChatML
// end-of-turn token is the model's end of sequence, so generation stops at a turn's end.
const (
	tokUnk   = 0
	tokBOS   = 1
	tokIMEnd = 4
)

// Token types as llama.cpp reads them from tokenizer.ggml.token_type.
const (
	typeNormal  = 1
	typeUnknown = 2
	typeControl = 3
	typeUnused  = 5
	typeByte    = 6
)

type vocab struct {
	tokens []string
	scores []float32
	types  []int32
	output []bool // whether the output head may produce the token
}

func (v *vocab) add(tok string, score float32, typ int32, out bool) {
	v.tokens = append(v.tokens, tok)
	v.scores = append(v.scores, score)
	v.types = append(v.types, typ)
	v.output = append(v.output, out)
}

// buildVocab makes a SentencePiece-style vocabulary: control tokens, the 256 byte-fallback
// tokens, single characters, and every word with all its prefixes (SPM merges pairs of
// pieces only into pieces that exist, so a word needs its prefixes to become one token).
// Longer pieces score higher, so the tokenizer prefers whole words. size > 0 pads the
// vocabulary with unused tokens.
func buildVocab(size int) vocab {
	var v vocab
	v.add("<unk>", 0, typeUnknown, false)
	v.add("<s>", 0, typeControl, false)
	v.add("</s>", 0, typeControl, false)
	v.add("<|im_start|>", 0, typeControl, false)
	v.add("<|im_end|>", 0, typeControl, false)
	for b := range 256 {
		v.add(fmt.Sprintf("<0x%02X>", b), 0, typeByte, false)
	}
	seen := map[string]bool{}
	piece := func(p string, out bool) {
		if seen[p] {
			if out {
				v.output[slices.Index(v.tokens, p)] = true
			}
			return
		}
		seen[p] = true
		v.add(p, float32(utf8.RuneCountInString(p)), typeNormal, out)
	}
	piece("▁", false)
	for c := byte('!'); c <= '~'; c++ {
		piece(string(c), strings.ContainsRune(",.!?", rune(c)))
	}
	for _, w := range words {
		for _, r := range w {
			piece(string(r), false)
		}
		w = "▁" + w
		for i := range w {
			if i > len("▁") {
				piece(w[:i], false)
			}
		}
		piece(w, true)
	}
	for i := len(v.tokens); i < size; i++ {
		v.add(fmt.Sprintf("<unused%d>", i), 0, typeUnused, false)
	}
	return v
}

// filler returns the value of element i of a tensor.
type filler func(i int, r *rand.Rand) float32

// tensorData writes a tensor's elements, drawn from a generator seeded by the model seed and
// the tensor's name, so tensors can be written in any order (WriteGGUF writes them
// concurrently) and the file is the same every time.
type tensorData struct {
	name     string
	kind     uint32
	n        int
	seed     uint64
	fill     filler
	progress *progress
}

// size is the bytes of one element.
func (t tensorData) size() int {
	if t.kind == 1 {
		return 2
	}
	return 4
}

func (t tensorData) WriteTo(w io.Writer) (int64, error) {
	h := fnv.New64a()
	h.Write([]byte(t.name))
	r := rand.New(rand.NewPCG(t.seed, h.Sum64()))
	size := t.size()
	const chunk = 1 << 16
	buf := make([]byte, 0, chunk*size)
	var written int64
	for i := 0; i < t.n; i++ {
		x := t.fill(i, r)
		if t.kind == 1 {
			buf = binary.LittleEndian.AppendUint16(buf, float16.Fromfloat32(x).Bits())
		} else {
			buf = binary.LittleEndian.AppendUint32(buf, math.Float32bits(x))
		}
		if len(buf) == cap(buf) || i == t.n-1 {
			n, err := w.Write(buf)
			written += int64(n)
			t.progress.add(n)
			if err != nil {
				return written, err
			}
			buf = buf[:0]
		}
	}
	if t.n == 0 {
		return 0, errors.New("empty tensor " + t.name)
	}
	return written, nil
}

// progress reports the writing of a large model on stderr, a line at every tenth of its
// tensors' bytes (tensors are written concurrently).
type progress struct {
	path  string
	total int64 // bytes of tensor data
	began time.Time
	done  atomic.Int64
	step  atomic.Int64 // the last tenth reported
}

// progressFrom is the smallest model whose writing is reported.
const progressFrom = 64 << 20

func (p *progress) start() {
	p.began = time.Now()
	if p.total >= progressFrom {
		fmt.Fprintf(os.Stderr, "mkmodel: writing %s (%d MiB of weights)\n", p.path, p.total>>20)
	}
}

func (p *progress) add(n int) {
	if p.total < progressFrom {
		return
	}
	step := p.done.Add(int64(n)) * 10 / p.total
	for s := p.step.Load(); step > s; s = p.step.Load() {
		if p.step.CompareAndSwap(s, step) {
			fmt.Fprintf(os.Stderr, "mkmodel: %d%% (%v)\n", 10*step, time.Since(p.began).Round(100*time.Millisecond))
			return
		}
	}
}

// Package llama is infernode's thin cgo layer over llama.cpp, as compiled into the binary by
// github.com/ollama/ollama/llama. It exposes exactly what the session engine needs and what
// ollama's Go wrapper does not: a unified KV pool (kv_unified), per-sequence KV positions,
// llama.cpp's native sampler chains, chat templates and model metadata.
//
// Nothing here is safe for concurrent use of one Context: the session engine owns each
// Context from a single goroutine. Model methods that only read the vocabulary (Tokenize,
// Piece, IsEOG, ApplyChatTemplate) may be called from any goroutine.
//
// The headers come from the ollama module (see the Makefile's CGO_CPPFLAGS); the compiled
// llama.cpp objects come from importing ollama's package.
package llama

/*
#cgo CPPFLAGS: -I${SRCDIR}/../../.build/include/llama -I${SRCDIR}/../../.build/include/ggml
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <sys/eventfd.h>
#include <unistd.h>
#include "llama.h"
#include "ggml-cpu.h"

// decoder runs llama_decode on a thread of its own and reports each batch done on an
// eventfd, which Go reads through its poller. A cgo call holds its P in a system call
// state; one longer than 10 ms (a decode step) has it retaken, and the call's return then
// wakes Go's sysmon into its 20 µs polling cadence: about 25 wake-ups a token at one
// stream, each preempting one of llama.cpp's threads on a machine whose cores they fill
// (docs/BENCHMARKS.md).
typedef struct decoder {
	pthread_t thread;
	pthread_mutex_t mu;
	pthread_cond_t cv;
	struct llama_context *ctx;
	struct llama_batch batch;
	int state; // 0: idle, 1: a batch to decode, 2: quit
	int32_t rc;
	int done; // eventfd: written once a batch is decoded
} decoder;

static void *decoder_main(void *arg) {
	decoder *d = arg;
	for (;;) {
		pthread_mutex_lock(&d->mu);
		while (d->state == 0) {
			pthread_cond_wait(&d->cv, &d->mu);
		}
		int quit = d->state == 2;
		struct llama_batch b = d->batch;
		pthread_mutex_unlock(&d->mu);
		if (quit) {
			return NULL;
		}
		int32_t rc = llama_decode(d->ctx, b);
		pthread_mutex_lock(&d->mu);
		d->rc = rc;
		if (d->state == 1) {
			d->state = 0; // not 2: a decoder_free that came meanwhile still stops the thread
		}
		pthread_mutex_unlock(&d->mu);
		uint64_t one = 1;
		if (write(d->done, &one, sizeof one) != sizeof one) {
			abort(); // only with a closed eventfd, which decoder_free's order rules out
		}
	}
}

static decoder *decoder_new(struct llama_context *ctx) {
	decoder *d = calloc(1, sizeof *d);
	if (d == NULL) {
		return NULL;
	}
	d->ctx = ctx;
	d->done = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	if (d->done < 0) {
		free(d);
		return NULL;
	}
	pthread_mutex_init(&d->mu, NULL);
	pthread_cond_init(&d->cv, NULL);
	if (pthread_create(&d->thread, NULL, decoder_main, d) != 0) {
		close(d->done);
		free(d);
		return NULL;
	}
	return d;
}

// decoder_start hands the thread a batch; its eventfd is written when it is decoded.
static void decoder_start(decoder *d, struct llama_batch b) {
	pthread_mutex_lock(&d->mu);
	d->batch = b;
	d->state = 1;
	pthread_cond_signal(&d->cv);
	pthread_mutex_unlock(&d->mu);
}

static int32_t decoder_rc(decoder *d) {
	pthread_mutex_lock(&d->mu);
	int32_t rc = d->rc;
	pthread_mutex_unlock(&d->mu);
	return rc;
}

// decoder_free stops the thread (between batches) and frees d; the eventfd stays open for
// its owner to close.
static void decoder_free(decoder *d) {
	pthread_mutex_lock(&d->mu);
	d->state = 2;
	pthread_cond_signal(&d->cv);
	pthread_mutex_unlock(&d->mu);
	pthread_join(d->thread, NULL);
	pthread_mutex_destroy(&d->mu);
	pthread_cond_destroy(&d->cv);
	free(d);
}

// new_threadpool starts a pool of n threads for a context's graphs (the decoding thread is
// one of them), with ggml's default polling between graphs.
static struct ggml_threadpool *new_threadpool(int n) {
	struct ggml_threadpool_params p = ggml_threadpool_params_default(n);
	return ggml_threadpool_new(&p);
}

// ggml-cpu.cpp calls the AMX buffer type under this condition, but ollama's cgo package
// never compiles ggml-cpu/amx/*.cpp: stop here with the fix rather than at the linker.
#if defined(__AMX_INT8__) && defined(__AVX512VNNI__)
#error "infernode: CGO_CFLAGS enable Intel AMX, which ollama's llama package cannot link; add -mno-amx-tile -mno-amx-int8 -mno-amx-bf16 (make does)"
#endif

extern void infernodeLlamaLog(int level, char *text, void *user_data);
extern bool infernodeLoadProgress(float progress, void *user_data);

// set_progress reports a model load's progress to the Go function registered as id.
static void set_progress(struct llama_model_params *p, uintptr_t id) {
	p->progress_callback = infernodeLoadProgress;
	p->progress_callback_user_data = (void *)id;
}

static void set_log(void) {
	llama_log_set((ggml_log_callback)infernodeLlamaLog, NULL);
}

// sample_logits runs a sampler chain over one row of logits and records the choice in its
// history. Unlike llama_sampler_sample it does not touch the context, so rows of one batch
// can be sampled on several threads at once. buf has room for n_vocab entries.
static llama_token_data_array candidates(const float *logits, int32_t n_vocab, llama_token_data *buf) {
	for (int32_t i = 0; i < n_vocab; i++) {
		buf[i].id = i;
		buf[i].logit = logits[i];
		buf[i].p = 0.0f;
	}
	llama_token_data_array arr = { buf, (size_t)n_vocab, -1, false };
	return arr;
}

static llama_token sample_logits(struct llama_sampler *s, const float *logits, int32_t n_vocab, llama_token_data *buf) {
	llama_token_data_array arr = candidates(logits, n_vocab, buf);
	llama_sampler_apply(s, &arr);
	llama_token tok = arr.data[arr.selected].id;
	llama_sampler_accept(s, tok);
	return tok;
}

// grammar_allows says whether grammar g, in its state, allows token tok next.
static bool grammar_allows(struct llama_sampler *g, llama_token tok) {
	llama_token_data one = { tok, 1.0f, 0.0f };
	llama_token_data_array single = { &one, 1, -1, false };
	llama_sampler_apply(g, &single);
	return single.data[0].logit != -INFINITY;
}

// sample_grammar is sample_logits under grammar g, as llama.cpp's server samples: the
// chain's choice when the grammar allows it (one token checked, the common case), else the
// chain's choice among the tokens the grammar allows (every one checked). The choice goes
// into both histories. -1: the grammar allows no token at all.
static llama_token sample_grammar(struct llama_sampler *s, struct llama_sampler *g, const float *logits, int32_t n_vocab, llama_token_data *buf) {
	llama_token_data_array arr = candidates(logits, n_vocab, buf);
	llama_sampler_apply(s, &arr);
	llama_token tok = arr.data[arr.selected].id;
	if (!grammar_allows(g, tok)) {
		arr = candidates(logits, n_vocab, buf);
		llama_sampler_apply(g, &arr);
		bool any = false;
		for (size_t i = 0; i < arr.size && !any; i++) {
			any = arr.data[i].logit != -INFINITY;
		}
		if (!any) {
			return -1;
		}
		llama_sampler_apply(s, &arr);
		tok = arr.data[arr.selected].id;
	}
	llama_sampler_accept(g, tok);
	llama_sampler_accept(s, tok);
	return tok;
}

// ggml's vectorized softmax kernel (ggml-cpu/vec.h; AVX-512, AVX2, SSE2, NEON or SVE as
// compiled): y = exp(x - max), returning the sum. Not in ggml's public headers, so declared
// here; it links from the ggml-cpu objects ollama's package compiles.
extern double ggml_vec_soft_max_f32(const int n, float *y, const float *x, float max);

// sample_temp draws a token from softmax(logits / temp) with u, uniform in [0, 1): the
// computation of llama.cpp's temp and dist samplers (logit / temp in float, exp(l - max),
// the first token whose running sum in double reaches u times the total), done on one
// contiguous row of n floats (p is scratch for them) with ggml's vectorized exp instead of
// a scalar expf on every element of a token-data array.
static llama_token sample_temp(const float *logits, int32_t n, float temp, float *p, double u) {
	for (int32_t i = 0; i < n; i++) {
		p[i] = logits[i] / temp;
	}
	float max = p[0];
	for (int32_t i = 1; i < n; i++) {
		max = p[i] > max ? p[i] : max;
	}
	double target = ggml_vec_soft_max_f32(n, p, p, max) * u, run = 0;
	for (int32_t i = 0; i < n; i++) {
		run += p[i];
		if (run >= target && p[i] > 0) {
			return i;
		}
	}
	int32_t last = n - 1; // rounding left the target just beyond the sum
	while (last > 0 && p[last] == 0) {
		last--;
	}
	return last;
}

static struct llama_batch batch_init(int32_t n) { return llama_batch_init(n, 0, 1); }

static void batch_add(struct llama_batch *b, llama_token tok, llama_pos pos, llama_seq_id seq, bool logits) {
	int i = b->n_tokens;
	b->token[i] = tok;
	b->pos[i] = pos;
	b->n_seq_id[i] = 1;
	b->seq_id[i][0] = seq;
	b->logits[i] = logits;
	b->n_tokens = i + 1;
}
*/
import "C"

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"math/rand/v2"
	"os"
	"runtime/cgo"
	"slices"
	"strings"
	"sync"
	"unsafe"

	"github.com/infernode/infernode/internal/keep"
	ollama "github.com/ollama/ollama/llama"
)

var initOnce sync.Once

// Init loads llama.cpp's backends and routes its log output to slog (Info and below at
// Debug, so a node's log is not flooded by model loading). It is safe to call more than once.
func Init() {
	initOnce.Do(func() {
		ollama.BackendInit()
		C.set_log()
	})
}

//export infernodeLlamaLog
func infernodeLlamaLog(level C.int, text *C.char, _ unsafe.Pointer) {
	lvl := slog.LevelDebug
	switch level {
	case C.GGML_LOG_LEVEL_WARN:
		lvl = slog.LevelWarn
	case C.GGML_LOG_LEVEL_ERROR:
		lvl = slog.LevelError
	}
	if !slog.Default().Enabled(context.Background(), lvl) {
		return
	}
	if msg := strings.TrimSpace(C.GoString(text)); msg != "" {
		slog.Log(context.Background(), lvl, msg, "component", "llama.cpp")
	}
}

// Model is a loaded GGUF model.
type Model struct {
	c     *C.struct_llama_model
	vocab *C.struct_llama_vocab
}

// ModelParams say how a model is loaded.
type ModelParams struct {
	// MMap maps the file's pages instead of reading the weights into memory of the
	// process's own. Mapped weights load at once and are shared by every process that
	// maps the file, but they lie where the file puts them: GGUF aligns tensors to 32
	// bytes, so a file's tensors may all start half-way into a 64-byte line, and every
	// AVX-512 load of a weight row then straddles two (a decode step 1.10x as long on a
	// 135M-parameter model, docs/BENCHMARKS.md); read weights start on a line.
	MMap bool
	// Progress, if not nil, is called from time to time with the fraction loaded so far
	// (0 to 1).
	Progress func(float32)
}

// LoadModel loads a GGUF file for CPU inference.
func LoadModel(path string, mp ModelParams) (*Model, error) {
	Init()
	p := C.llama_model_default_params()
	p.n_gpu_layers = 0
	p.use_mmap = C.bool(mp.MMap)
	if progress := mp.Progress; progress != nil {
		h := cgo.NewHandle(progress)
		defer h.Delete()
		C.set_progress(&p, C.uintptr_t(h))
	}
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	m := C.llama_model_load_from_file(cpath, p)
	if m == nil {
		return nil, fmt.Errorf("load model %s: llama.cpp could not load it (see log)", path)
	}
	return &Model{c: m, vocab: C.llama_model_get_vocab(m)}, nil
}

//export infernodeLoadProgress
func infernodeLoadProgress(progress C.float, id unsafe.Pointer) C.bool {
	cgo.Handle(uintptr(id)).Value().(func(float32))(float32(progress))
	return true // go on loading
}

// Close frees the model. Contexts made from it must be closed first.
func (m *Model) Close() {
	if m.c != nil {
		C.llama_model_free(m.c)
		m.c = nil
	}
}

// NumVocab is the number of tokens in the vocabulary.
func (m *Model) NumVocab() int { return int(C.llama_vocab_n_tokens(m.vocab)) }

// TrainedContext is the context length the model was trained for.
func (m *Model) TrainedContext() int { return int(C.llama_model_n_ctx_train(m.c)) }

// Description is llama.cpp's one-line description of the model (architecture, size, type).
func (m *Model) Description() string {
	var buf [256]C.char
	n := C.llama_model_desc(m.c, &buf[0], C.size_t(len(buf)))
	if n < 0 {
		return ""
	}
	return C.GoString(&buf[0])
}

// quantTypes are the weight types Quantize writes, by the names llama.cpp's quantize tool
// gives them; "_M" and "_S" mixes keep some tensors at more bits (llama.cpp's choice).
var quantTypes = map[string]C.enum_llama_ftype{
	"f16":    C.LLAMA_FTYPE_MOSTLY_F16,
	"q8_0":   C.LLAMA_FTYPE_MOSTLY_Q8_0,
	"q6_k":   C.LLAMA_FTYPE_MOSTLY_Q6_K,
	"q5_k_m": C.LLAMA_FTYPE_MOSTLY_Q5_K_M,
	"q4_k_m": C.LLAMA_FTYPE_MOSTLY_Q4_K_M,
	"q4_k_s": C.LLAMA_FTYPE_MOSTLY_Q4_K_S,
	"q4_0":   C.LLAMA_FTYPE_MOSTLY_Q4_0,
}

// ErrQuantType: Quantize was asked for a type it does not write.
var ErrQuantType = errors.New("quantize: unknown type")

// QuantTypes are the names of the weight types Quantize writes, sorted.
func QuantTypes() []string { return slices.Sorted(maps.Keys(quantTypes)) }

// Quantize writes the GGUF model at in to out with its weights in type kind (one of
// QuantTypes), using llama.cpp's own quantizer (llama_model_quantize) on threads threads.
func Quantize(in, out, kind string, threads int) error {
	ftype, ok := quantTypes[strings.ToLower(kind)]
	if !ok {
		return fmt.Errorf("%w %q (want one of %s)", ErrQuantType, kind, strings.Join(QuantTypes(), ", "))
	}
	Init()
	p := C.llama_model_quantize_default_params()
	p.ftype = ftype
	p.nthread = C.int32_t(threads)
	cin, cout := C.CString(in), C.CString(out)
	defer C.free(unsafe.Pointer(cin))
	defer C.free(unsafe.Pointer(cout))
	if rc := C.llama_model_quantize(cin, cout, &p); rc != 0 {
		return fmt.Errorf("quantize %s to %s as %s: llama.cpp failed (%d; its log says why)", in, out, kind, rc)
	}
	return nil
}

// Meta returns a metadata value of the GGUF file as a string.
func (m *Model) Meta(key string) (string, bool) {
	ckey := C.CString(key)
	defer C.free(unsafe.Pointer(ckey))
	buf := make([]byte, 1024)
	for {
		n := C.llama_model_meta_val_str(m.c, ckey, (*C.char)(unsafe.Pointer(&buf[0])), C.size_t(len(buf)))
		if n < 0 {
			return "", false
		}
		if int(n) < len(buf) {
			return string(buf[:n]), true
		}
		buf = make([]byte, int(n)+1)
	}
}

// ChatTemplate is the model's chat template, or "" when the GGUF has none.
func (m *Model) ChatTemplate() string {
	t := C.llama_model_chat_template(m.c, nil)
	if t == nil {
		return ""
	}
	return C.GoString(t)
}

// IsEOG reports whether a token ends generation (end of sequence, end of turn).
func (m *Model) IsEOG(tok int32) bool { return bool(C.llama_vocab_is_eog(m.vocab, C.llama_token(tok))) }

// Tokenize turns text into tokens. addSpecial adds the model's BOS token where it wants
// one; parseSpecial turns control-token text such as <|im_start|> into those tokens.
func (m *Model) Tokenize(text string, addSpecial, parseSpecial bool) ([]int32, error) {
	if text == "" && !addSpecial {
		return nil, nil
	}
	ctext := C.CString(text)
	defer C.free(unsafe.Pointer(ctext))
	toks := make([]int32, len(text)+2)
	for {
		n := C.llama_tokenize(m.vocab, ctext, C.int32_t(len(text)),
			(*C.llama_token)(unsafe.Pointer(&toks[0])), C.int32_t(len(toks)), C.bool(addSpecial), C.bool(parseSpecial))
		if n >= 0 {
			return toks[:n], nil
		}
		if int(-n) <= len(toks) {
			return nil, fmt.Errorf("tokenize: llama.cpp failed (%d)", n)
		}
		toks = make([]int32, -n)
	}
}

// IsControl reports whether tok is a control (or unknown) token: one that text tokenized
// without parseSpecial never produces.
func (m *Model) IsControl(tok int32) bool {
	return C.llama_vocab_get_attr(m.vocab, C.llama_token(tok))&(C.LLAMA_TOKEN_ATTR_CONTROL|C.LLAMA_TOKEN_ATTR_UNKNOWN) != 0
}

// Piece returns the bytes a token stands for. Control tokens render as empty. A piece may
// be part of a UTF-8 character (byte-fallback tokens): callers join pieces before decoding.
func (m *Model) Piece(tok int32) []byte {
	buf := make([]byte, 32)
	for {
		n := C.llama_token_to_piece(m.vocab, C.llama_token(tok), (*C.char)(unsafe.Pointer(&buf[0])), C.int32_t(len(buf)), 0, false)
		if n >= 0 {
			return buf[:n]
		}
		buf = make([]byte, -n)
	}
}

// Message is one chat turn for ApplyChatTemplate.
type Message struct {
	Role, Content string
}

// ErrUnknownTemplate means llama.cpp does not recognise a chat template.
var ErrUnknownTemplate = errors.New("chat template not supported by llama.cpp")

// ApplyChatTemplate formats messages with a chat template: a Jinja template from a GGUF
// (llama.cpp recognises the common families by their markers) or a built-in name such as
// "chatml" or "llama3". addAssistant appends the opening of the assistant's turn.
func ApplyChatTemplate(tmpl string, msgs []Message, addAssistant bool) (string, error) {
	ctmpl := C.CString(tmpl)
	defer C.free(unsafe.Pointer(ctmpl))
	cmsgs := unsafe.Slice((*C.struct_llama_chat_message)(C.malloc(C.size_t(max(len(msgs), 1))*C.sizeof_struct_llama_chat_message)), len(msgs))
	defer C.free(unsafe.Pointer(unsafe.SliceData(cmsgs)))
	size := 0
	for i, msg := range msgs {
		cmsgs[i].role = C.CString(msg.Role)
		cmsgs[i].content = C.CString(msg.Content)
		size += len(msg.Role) + len(msg.Content)
	}
	defer func() {
		for _, cm := range cmsgs {
			C.free(unsafe.Pointer(cm.role))
			C.free(unsafe.Pointer(cm.content))
		}
	}()
	var first *C.struct_llama_chat_message
	if len(cmsgs) > 0 {
		first = &cmsgs[0]
	}
	buf := make([]byte, 2*size+256)
	for {
		n := C.llama_chat_apply_template(ctmpl, first, C.size_t(len(msgs)), C.bool(addAssistant),
			(*C.char)(unsafe.Pointer(&buf[0])), C.int32_t(len(buf)))
		if n < 0 {
			return "", ErrUnknownTemplate
		}
		if int(n) <= len(buf) {
			return string(buf[:n]), nil
		}
		buf = make([]byte, n)
	}
}

// ContextParams configures a Context.
type ContextParams struct {
	Cells     int    // KV cells in all (llama.cpp's n_ctx)
	Sequences int    // sequence ids the context holds at once (n_seq_max)
	Batch     int    // tokens per llama_decode call (n_batch = n_ubatch)
	Threads   int    // CPU threads for decode and prefill
	Unified   bool   // one KV pool for all sequences (kv_unified) rather than fixed partitions
	KVType    string // "f16" (default), "q8_0" or "q4_0"
	FlashAttn bool   // flash attention (needed by a quantized V cache)
}

// Context is a llama.cpp inference context with its own KV cache.
type Context struct {
	c     *C.struct_llama_context
	pool  *C.struct_ggml_threadpool
	dec   *C.decoder
	done  *os.File // dec's eventfd
	mem   C.llama_memory_t
	model *Model
}

// NewContext makes an inference context for m.
func NewContext(m *Model, p ContextParams) (*Context, error) {
	cp := C.llama_context_default_params()
	cp.n_ctx = C.uint32_t(p.Cells)
	cp.n_batch = C.uint32_t(p.Batch)
	cp.n_ubatch = C.uint32_t(p.Batch)
	cp.n_seq_max = C.uint32_t(p.Sequences)
	cp.n_threads = C.int32_t(p.Threads)
	cp.n_threads_batch = C.int32_t(p.Threads)
	cp.kv_unified = C.bool(p.Unified)
	cp.no_perf = true
	cp.embeddings = false
	cp.flash_attn_type = C.LLAMA_FLASH_ATTN_TYPE_DISABLED
	if p.FlashAttn {
		cp.flash_attn_type = C.LLAMA_FLASH_ATTN_TYPE_ENABLED
	}
	switch strings.ToLower(p.KVType) {
	case "", "f16":
		cp.type_k, cp.type_v = C.GGML_TYPE_F16, C.GGML_TYPE_F16
	case "q8_0":
		cp.type_k, cp.type_v = C.GGML_TYPE_Q8_0, C.GGML_TYPE_Q8_0
	case "q4_0":
		cp.type_k, cp.type_v = C.GGML_TYPE_Q4_0, C.GGML_TYPE_Q4_0
	default:
		return nil, fmt.Errorf("new context: unknown KV cache type %q (want f16, q8_0 or q4_0)", p.KVType)
	}
	c := C.llama_init_from_model(m.c, cp)
	if c == nil {
		return nil, errors.New("new context: llama.cpp could not create it (see log)")
	}
	// Without a pool of its own, ggml starts and joins its worker threads for every graph,
	// so every token (docs/BENCHMARKS.md: with the pool, 14% more tokens/s through HTTP at
	// one stream, 9% at eight).
	pool := C.new_threadpool(C.int(p.Threads))
	if pool == nil {
		C.llama_free(c)
		return nil, errors.New("new context: ggml could not start its threads")
	}
	C.llama_attach_threadpool(c, pool, pool)
	dec := C.decoder_new(c)
	if dec == nil {
		C.llama_free(c)
		C.ggml_threadpool_free(pool)
		return nil, errors.New("new context: could not start the decoding thread")
	}
	done := os.NewFile(uintptr(dec.done), "llama-decode-done")
	return &Context{c: c, pool: pool, dec: dec, done: done, mem: C.llama_get_memory(c), model: m}, nil
}

// Close frees the context. It is safe to call twice.
func (c *Context) Close() {
	if c.dec != nil {
		C.decoder_free(c.dec)
		c.done.Close()
		c.dec = nil
	}
	if c.c != nil {
		C.llama_free(c.c)
		c.c = nil
	}
	if c.pool != nil {
		C.ggml_threadpool_free(c.pool)
		c.pool = nil
	}
}

// Cells is the KV cache size in cells (tokens) over all sequences.
func (c *Context) Cells() int { return int(C.llama_n_ctx(c.c)) }

// SeqCells is how many cells one sequence may use: Cells with a unified pool, an equal
// share of it without.
func (c *Context) SeqCells() int { return int(C.llama_n_ctx_seq(c.c)) }

// Sequences is the number of sequence ids the context accepts.
func (c *Context) Sequences() int { return int(C.llama_n_seq_max(c.c)) }

// ErrNoKVSlot means llama_decode found no room in the KV cache for the batch.
var ErrNoKVSlot = errors.New("decode: no KV cache slot for the batch")

// Decode runs the model over a batch. The decoding thread runs it while this goroutine
// waits in Go's poller, holding no P.
func (c *Context) Decode(b *Batch) error {
	C.decoder_start(c.dec, b.c)
	var n [8]byte
	if _, err := io.ReadFull(c.done, n[:]); err != nil {
		return fmt.Errorf("decode: waiting for the decoding thread: %w", err)
	}
	switch rc := C.decoder_rc(c.dec); {
	case rc == 0:
		return nil
	case rc == 1:
		return ErrNoKVSlot
	default:
		return fmt.Errorf("decode: llama_decode returned %d", rc)
	}
}

// SeqRemove drops a sequence's KV cells at positions [from, to); to < 0 means to the end.
func (c *Context) SeqRemove(seq, from, to int) bool {
	return bool(C.llama_memory_seq_rm(c.mem, C.llama_seq_id(seq), C.llama_pos(from), C.llama_pos(to)))
}

// SeqCopy makes the cells of src at positions [0, n) dst's too. In a unified pool the
// cells are shared, not copied: dst then decodes from position n on.
func (c *Context) SeqCopy(src, dst, n int) {
	C.llama_memory_seq_cp(c.mem, C.llama_seq_id(src), C.llama_seq_id(dst), 0, C.llama_pos(n))
}

// SeqPosMax is the largest position a sequence holds in the KV cache, or -1 when it holds none.
func (c *Context) SeqPosMax(seq int) int {
	return int(C.llama_memory_seq_pos_max(c.mem, C.llama_seq_id(seq)))
}

// SeqState copies a sequence's state (its KV cells and what llama.cpp needs to restore
// them) into buf, grown if need be, and returns it.
func (c *Context) SeqState(seq int, buf []byte) ([]byte, error) {
	n := C.llama_state_seq_get_size(c.c, C.llama_seq_id(seq))
	if n == 0 {
		return nil, fmt.Errorf("sequence %d: no state", seq)
	}
	if cap(buf) < int(n) {
		buf = keep.Fresh(int(n)) // tens of megabytes: first touched by the copy below
	}
	buf = buf[:int(n)]
	got := C.llama_state_seq_get_data(c.c, (*C.uint8_t)(unsafe.Pointer(&buf[0])), n, C.llama_seq_id(seq))
	if got == 0 || got > n {
		return nil, fmt.Errorf("sequence %d: copying its state failed", seq)
	}
	return buf[:int(got)], nil
}

// SetSeqState restores a state SeqState copied (here or in a context of the same model
// and KV layout) into sequence seq, which should be empty.
func (c *Context) SetSeqState(seq int, state []byte) error {
	if len(state) == 0 {
		return errors.New("empty sequence state")
	}
	if C.llama_state_seq_set_data(c.c, (*C.uint8_t)(unsafe.Pointer(&state[0])), C.size_t(len(state)), C.llama_seq_id(seq)) == 0 {
		return fmt.Errorf("sequence %d: llama.cpp refused the state (%d bytes)", seq, len(state))
	}
	return nil
}

// Clear empties the whole KV cache.
func (c *Context) Clear() { C.llama_memory_clear(c.mem, true) }

// Batch is a llama_batch of tokens, each for one sequence.
type Batch struct {
	c   C.struct_llama_batch
	cap int
}

// NewBatch allocates a batch of up to n tokens.
func NewBatch(n int) *Batch { return &Batch{c: C.batch_init(C.int32_t(n)), cap: n} }

// Add appends a token at position pos of sequence seq. logits asks for its output row,
// which Sample reads by the token's index in the batch. It returns that index.
func (b *Batch) Add(tok int32, pos, seq int, logits bool) int {
	if b.Len() >= b.cap {
		panic("llama: batch overflow") // a bug in the caller's budget, never input-driven
	}
	i := b.Len()
	C.batch_add(&b.c, C.llama_token(tok), C.llama_pos(pos), C.llama_seq_id(seq), C.bool(logits))
	return i
}

// Len is the number of tokens in the batch.
func (b *Batch) Len() int { return int(b.c.n_tokens) }

// Cap is the most tokens the batch holds.
func (b *Batch) Cap() int { return b.cap }

// Clear empties the batch.
func (b *Batch) Clear() { b.c.n_tokens = 0 }

// Free releases the batch's memory.
func (b *Batch) Free() {
	if b.cap > 0 {
		C.llama_batch_free(b.c)
		b.cap = 0
	}
}

// SamplerParams configures a sampler chain. Zero values switch a stage off, except
// Temperature: 0 means greedy.
type SamplerParams struct {
	Temperature      float32
	TopK             int
	TopP             float32 // 1 disables
	MinP             float32
	RepeatLastN      int // tokens the penalties look back over
	RepeatPenalty    float32
	FrequencyPenalty float32
	PresencePenalty  float32
	Seed             uint32
	// Grammar, if set, is a GBNF grammar (root rule "root") every answer must match:
	// sampling is constrained to the tokens it allows.
	Grammar string
}

// Sampler is a llama.cpp sampler chain with its own RNG and penalty history, and its own
// candidate buffer, so different Samplers may sample rows of one batch concurrently.
//
// The commonest request, a temperature and nothing else (OpenAI's defaults), skips the
// chain: sample_temp makes the same draw on the row itself with ggml's vectorized exp, from
// a PCG stream seeded with Seed: 44 µs a row against the chain's 460 µs over a 49k-token
// vocabulary (BenchmarkSample, docs/BENCHMARKS.md).
type Sampler struct {
	c      *C.struct_llama_sampler // nil on the temperature-only path
	buf    *C.llama_token_data     // the chain's candidates
	nVocab int
	// The temperature-only path: its temperature, the row's probabilities, uniform draws.
	temp  float32
	probs *C.float
	rng   *rand.Rand
	// grammar constrains the chain's choices (nil: none).
	grammar *C.struct_llama_sampler
}

// NewSampler builds the chain penalties → top-k → top-p → min-p → temperature → draw (or
// greedy when Temperature is 0), the order llama.cpp's own server uses, under p.Grammar if
// set. A grammar llama.cpp cannot parse is an error.
func NewSampler(m *Model, p SamplerParams) (*Sampler, error) {
	if p.Grammar != "" {
		s := newChain(m, p)
		grammar, root := C.CString(p.Grammar), C.CString("root")
		defer C.free(unsafe.Pointer(grammar))
		defer C.free(unsafe.Pointer(root))
		if s.grammar = C.llama_sampler_init_grammar(m.vocab, grammar, root); s.grammar == nil {
			s.Free()
			return nil, errors.New("llama: the grammar does not parse")
		}
		return s, nil
	}
	if p.Temperature > 0 && !p.penalties() && p.TopK <= 0 && (p.TopP <= 0 || p.TopP >= 1) && p.MinP <= 0 {
		n := m.NumVocab()
		return &Sampler{nVocab: n, temp: p.Temperature, probs: (*C.float)(C.malloc(C.size_t(n) * C.sizeof_float)),
			rng: rand.New(rand.NewPCG(uint64(p.Seed), 0))}, nil
	}
	return newChain(m, p), nil
}

func (p SamplerParams) penalties() bool {
	return p.RepeatLastN != 0 && (p.RepeatPenalty != 1 && p.RepeatPenalty != 0 || p.FrequencyPenalty != 0 || p.PresencePenalty != 0)
}

// newChain builds llama.cpp's sampler chain for p.
func newChain(m *Model, p SamplerParams) *Sampler {
	chain := C.llama_sampler_chain_init(C.llama_sampler_chain_default_params())
	add := func(s *C.struct_llama_sampler) { C.llama_sampler_chain_add(chain, s) }
	if p.penalties() {
		rp := p.RepeatPenalty
		if rp == 0 {
			rp = 1
		}
		add(C.llama_sampler_init_penalties(C.int32_t(p.RepeatLastN), C.float(rp), C.float(p.FrequencyPenalty), C.float(p.PresencePenalty)))
	}
	n := m.NumVocab()
	s := &Sampler{c: chain, nVocab: n, buf: (*C.llama_token_data)(C.malloc(C.size_t(n) * C.sizeof_llama_token_data))}
	if p.Temperature <= 0 {
		add(C.llama_sampler_init_greedy())
		return s
	}
	if p.TopK > 0 {
		add(C.llama_sampler_init_top_k(C.int32_t(p.TopK)))
	}
	if p.TopP > 0 && p.TopP < 1 {
		add(C.llama_sampler_init_top_p(C.float(p.TopP), 1))
	}
	if p.MinP > 0 {
		add(C.llama_sampler_init_min_p(C.float(p.MinP), 1))
	}
	add(C.llama_sampler_init_temp(C.float(p.Temperature)))
	add(C.llama_sampler_init_dist(C.uint32_t(p.Seed)))
	return s
}

// Accept feeds a token the sampler did not choose (a prompt token) into its penalty history.
func (s *Sampler) Accept(tok int32) {
	if s.c != nil {
		C.llama_sampler_accept(s.c, C.llama_token(tok))
	}
}

// Logits is one row of output logits from the last Decode.
type Logits struct{ p *C.float }

// Row is the logits as n floats (n: the vocabulary's size). It is valid until the next
// Decode.
func (l Logits) Row(n int) []float32 { return unsafe.Slice((*float32)(unsafe.Pointer(l.p)), n) }

// Logits returns the output row of batch index idx of the last Decode. Call it from the
// goroutine that owns the context; the row stays valid until the next Decode.
func (c *Context) Logits(idx int) Logits { return Logits{C.llama_get_logits_ith(c.c, C.int32_t(idx))} }

// Sample picks the next token from a row of logits and records it in the sampler's
// history. Different Samplers may sample concurrently.
// Under a grammar that allows no token at all, it returns -1.
func (s *Sampler) Sample(l Logits) int32 {
	switch {
	case s.grammar != nil:
		return int32(C.sample_grammar(s.c, s.grammar, l.p, C.int32_t(s.nVocab), s.buf))
	case s.c == nil:
		return s.draw(l, s.rng.Float64())
	}
	return int32(C.sample_logits(s.c, l.p, C.int32_t(s.nVocab), s.buf))
}

// SchemaToGrammar compiles a JSON schema to the GBNF grammar that enforces it, with
// llama.cpp's converter (through ollama's binding); "" when it cannot. The converter
// ignores keywords it cannot express: callers check the schema's keywords first.
func SchemaToGrammar(schema []byte) string { return string(ollama.SchemaToGrammar(schema)) }

// Follow advances the grammar over tokens already in the answer (generated before it
// moved here), so sampling goes on where they left it. llama.cpp's grammar works on the
// tokens' characters, so any tokenization of the same text gives the same state. A token
// the grammar does not allow is refused before it could corrupt the grammar's state.
func (s *Sampler) Follow(tokens []int32) error {
	for i, tok := range tokens {
		if !C.grammar_allows(s.grammar, C.llama_token(tok)) {
			return fmt.Errorf("llama: the grammar does not allow token %d of the answer so far (%d)", i, tok)
		}
		C.llama_sampler_accept(s.grammar, C.llama_token(tok))
	}
	return nil
}

// draw is the temperature-only path's choice for the uniform draw u.
func (s *Sampler) draw(l Logits, u float64) int32 {
	return int32(C.sample_temp(l.p, C.int32_t(s.nVocab), C.float(s.temp), s.probs, C.double(u)))
}

// Free releases the sampler. It is safe to call twice.
func (s *Sampler) Free() {
	if s.c != nil {
		C.llama_sampler_free(s.c)
	}
	if s.grammar != nil {
		C.llama_sampler_free(s.grammar)
	}
	C.free(unsafe.Pointer(s.buf))
	C.free(unsafe.Pointer(s.probs))
	s.c, s.buf, s.probs, s.grammar = nil, nil, nil, nil
}

// SampleRow is Sample for a row Logits.Row returned.
func (s *Sampler) SampleRow(row []float32) int32 {
	return s.Sample(Logits{(*C.float)(unsafe.Pointer(unsafe.SliceData(row)))})
}

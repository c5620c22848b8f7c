package session

import (
	"log/slog"
	"runtime"
	"time"

	"github.com/infernode/infernode/internal/validate"
)

// Config configures an Engine. Build one with DefaultConfig and change what you need.
type Config struct {
	// ModelPath is the GGUF file to load. Required.
	ModelPath string
	// LoadProgress, if not nil, is called while the model loads with the fraction loaded
	// (0 to 1).
	LoadProgress func(fraction float32)
	// MMap maps the model file instead of reading its weights into the process's memory:
	// a faster start and pages shared with other processes that map the file, but the
	// weights lie where the file puts them, perhaps off the cache lines (see
	// llama.ModelParams.MMap). Default false.
	MMap bool
	// Cells is the number of KV cache cells (tokens) over all sequences. Default 8192.
	Cells int
	// Sequences is how many requests run at once, prefilled or decoded in the same steps.
	// Default 8.
	Sequences int
	// Conversations is how many conversations the engine holds at once, running or cached
	// idle for their next turn (llama.cpp's sequence ids). An idle one keeps its cells in
	// the pool, or with HostKV in host memory, until room is needed for another. With a
	// unified pool it may exceed Sequences, up to 256; 0 means 4x Sequences there, so
	// that a node serving more conversations than it runs at once (a survivor taking over
	// a dead peer's, replicas beside its own) keeps their histories for as long as cells
	// and host memory hold them, not only Sequences of them. Without a unified pool each
	// running sequence has its own partition of the cells: with HostKV the conversations
	// take turns in the partitions (0 means 4x Sequences again), without it there are
	// Sequences of them.
	Conversations int
	// BatchSize is the most tokens one step decodes: one per running sequence plus prefill
	// chunks. Default 512.
	BatchSize int
	// PrefillSlice bounds how long one step may spend prefilling while requests decode
	// or several prompts wait, at the prefill rate measured over whole steps (so beside
	// decoding rows it bounds about the whole step; shortest prompt first; a lone prompt,
	// or any while a request waits for admission, may use the whole batch). Shorter
	// gives decoding streams steadier tokens and short prompts behind long ones their
	// first tokens sooner; longer spends less on step overhead. Default 100ms
	// (docs/BENCHMARKS.md).
	PrefillSlice time.Duration
	// Threads is the number of CPU threads llama.cpp uses. Default: all CPUs.
	Threads int
	// UnifiedKV makes all sequences share one pool of Cells (llama.cpp's kv_unified), so a
	// long conversation can use what short ones leave free. Without it every sequence gets
	// a fixed Cells/Sequences partition. Default true; see docs/ARCHITECTURE.md.
	UnifiedKV bool
	// KVType is the KV cache element type: f16, q8_0 or q4_0. Default f16.
	KVType string
	// FlashAttn computes attention with llama.cpp's flash attention kernel, on CPU a loop
	// over the cached cells for each new token and head that skips other sequences'
	// cells. Off, attention is matrix products over every cell in the pool's used range
	// and a softmax: it prefills many tokens over a long history faster, but costs more
	// with other conversations' cells resident (docs/BENCHMARKS.md, "Where the engine's
	// time goes: attention"). A quantized KV cache needs it. It shapes the KV cache
	// (without it llama.cpp stores V transposed), so it is in the fingerprint. Default
	// true.
	FlashAttn bool
	// SeqContext is the most tokens (prompt and answer) one conversation may hold. 0 means
	// the model's trained context: a model is not trained for positions beyond it, and
	// answers there degrade. Asking for more is the operator's choice. Either way it is
	// at most what one sequence may use of the KV pool. Default 0.
	SeqContext int
	// MaxPromptTokens refuses longer prompts with ErrPromptTooLong. 0 means no limit but
	// the sequence's context. Default 0.
	MaxPromptTokens int
	// DefaultMaxTokens caps generation when a request names no limit. Default 1024.
	// (In a unified pool a request claims cells for its prompt and at most Cells/Sequences
	// generated tokens at admission, and more as it decodes; see docs/ARCHITECTURE.md.)
	DefaultMaxTokens int
	// MaxQueue is how many requests may wait for admission; more are refused at once
	// with ErrOverloaded. Default 64.
	MaxQueue int
	// QueueTimeout is how long a request may wait for admission before it is refused with
	// ErrOverloaded. Default 30s.
	QueueTimeout time.Duration
	// HostKV moves an idle conversation's KV cells out of a unified pool into host memory
	// once requests have decoded beside it for a few steps, and back when its next turn
	// comes (a copy of tens of megabytes, against a prefill of its history). Every token
	// a step decodes reads the pool's whole used range of cells, idle conversations' too
	// (docs/BENCHMARKS.md, "the idle histories' cells"), so cached histories slow every
	// stream beside them. Without a unified pool it moves an idle conversation out of its
	// partition only when another conversation needs the partition (see Conversations).
	// Default true.
	HostKV bool
	// HostCells is the most tokens whose KV HostKV keeps in host memory: the KV pool's
	// memory again when 0 (the default), as Cells is.
	HostCells int
	// NoPreempt keeps a batch request in its sequence until it ends, instead of parking it
	// (its KV copied out, to resume later) for an interactive request that finds no room:
	// the comparison BenchmarkBatchPriority makes. Default false.
	NoPreempt bool
	// Fingerprint identifies the model file and KV type in KV frames (see Export); only
	// an engine with the same one imports them. Empty: computed by New (it reads the whole
	// model file once).
	Fingerprint string
	// Seed seeds the engine's random source, which draws the seeds of requests that ask
	// for a random one. It is logged at start so a run can be replayed. Default 0: from
	// the clock.
	Seed uint64
	// Logger receives the engine's logs. Nil means slog.Default().
	Logger *slog.Logger
}

// DefaultConfig returns the configuration infernode runs with unless told otherwise.
func DefaultConfig() Config {
	return Config{
		Cells:            8192,                   // 8 sequences of 1k tokens, or fewer longer ones
		Sequences:        8,                      // 2.5x aggregate decode at 8 on 2 cores (docs/BENCHMARKS.md)
		BatchSize:        512,                    // prefill chunk large enough to reach full speed
		PrefillSlice:     100 * time.Millisecond, // ~70 tokens a step on the realistic shape, 2 cores
		Threads:          runtime.NumCPU(),       // the engine is the process's main work
		UnifiedKV:        true,
		HostKV:           true,
		KVType:           "f16",
		FlashAttn:        true,
		DefaultMaxTokens: 1024,
		MaxQueue:         64,
		QueueTimeout:     30 * time.Second,
	}
}

// maxSeqs is llama.cpp's most sequence ids in a context (LLAMA_MAX_SEQ).
const maxSeqs = 256

// conversations is Conversations with its default applied (see Conversations).
func (c Config) conversations() int {
	switch {
	case !c.UnifiedKV && !c.HostKV:
		return c.Sequences
	case c.Conversations == 0:
		return min(4*c.Sequences, maxSeqs)
	}
	return c.Conversations
}

// seqIDs is how many sequence ids llama.cpp's context has: one a conversation in a unified
// pool, one a partition without (a conversation holds one while it runs or its cells are
// in the pool: see Engine.seqFor).
func (c Config) seqIDs() int {
	if c.UnifiedKV {
		return c.conversations()
	}
	return c.Sequences
}

// Validate reports every problem with c at once.
func (c Config) Validate() error {
	p := validate.New("")
	check := p.Check
	check(c.ModelPath != "", "model path is required")
	check(c.Sequences >= 1 && c.Sequences <= maxSeqs, "sequences must be in [1, %d], got %d", maxSeqs, c.Sequences)
	check(c.Conversations == 0 || c.Conversations >= c.Sequences && c.Conversations <= maxSeqs,
		"conversations must be 0 or in [sequences %d, %d], got %d", c.Sequences, maxSeqs, c.Conversations)
	check(c.UnifiedKV || c.HostKV || c.Conversations == 0 || c.Conversations == c.Sequences,
		"conversations %d must be sequences %d without a unified pool or host memory (each has its own partition)", c.Conversations, c.Sequences)
	check(c.BatchSize >= c.Sequences, "batch size %d must be at least the number of sequences %d", c.BatchSize, c.Sequences)
	check(c.Cells >= 16, "KV cells must be at least 16, got %d", c.Cells)
	check(c.UnifiedKV || c.Cells/max(c.Sequences, 1) >= 16,
		"KV cells %d leave fewer than 16 per sequence without a unified pool", c.Cells)
	check(c.Threads >= 1, "threads must be at least 1, got %d", c.Threads)
	check(c.KVType == "f16" || c.KVType == "q8_0" || c.KVType == "q4_0", "KV type must be f16, q8_0 or q4_0, got %q", c.KVType)
	check(c.FlashAttn || c.KVType == "f16", "a %s KV cache needs flash attention", c.KVType)
	check(c.DefaultMaxTokens >= 1, "default max tokens must be at least 1, got %d", c.DefaultMaxTokens)
	check(c.MaxPromptTokens >= 0, "max prompt tokens must not be negative, got %d", c.MaxPromptTokens)
	check(c.SeqContext >= 0, "context per conversation must not be negative, got %d", c.SeqContext)
	check(c.HostCells >= 0, "host KV cells must not be negative, got %d", c.HostCells)
	check(c.MaxQueue >= 0, "max queue must not be negative, got %d", c.MaxQueue)
	p.Positive("queue timeout", c.QueueTimeout)
	p.Positive("prefill slice", c.PrefillSlice)
	return p.Err()
}

// Package answers keeps whole answers to greedy requests, so that the same request asked
// again is answered from memory instead of computed: an exact-match response cache, on the
// node that serves the request (its conversation's owner, so a request asked again, at
// any node, comes to the same cache).
//
// A request is cached only when it asks (infer.Request.CacheAnswer: per request, or for
// every request of a tenant that opts in) and only when its answer is a function of the
// request: greedy sampling, nothing resumed. The key is a hash of everything that shapes
// the answer: the model's fingerprint, the request's sharing domain (its tenant and cache
// salt: no tenant is ever answered from another's entry), the prompt (text or tokens) and
// every generation parameter. A cached answer is replayed as its stream was, with the
// same finish reason, counts and log probabilities; its result says it came from the
// cache (infer.Result.FromCache) and that every prompt token was cached.
//
// Greedy answers from a batched engine can differ at a near-tie with what runs beside
// them (the chaos suite proves such differences are near-ties): the cache answers with
// the first one computed, which is a greedy answer to the request all the same.
//
// The cache is bounded in bytes (least recently used out) and by a time to live.
package answers

import (
	"container/list"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/infernode/infernode/internal/validate"
	"github.com/infernode/infernode/session/infer"
)

// Config bounds the cache.
type Config struct {
	// MaxBytes bounds the answers kept (their text and log probabilities); 0 turns the
	// cache off.
	MaxBytes int64
	// TTL is how long an answer is served after it was computed.
	TTL time.Duration
}

// DefaultConfig is infernode's: 32 MiB of answers for up to an hour.
func DefaultConfig() Config { return Config{MaxBytes: 32 << 20, TTL: time.Hour} }

// Validate reports every problem with c at once.
func (c Config) Validate() error {
	p := validate.New("")
	p.Check(c.MaxBytes >= 0, "response cache bytes must not be negative, got %d", c.MaxBytes)
	p.Positive("response cache TTL", c.TTL)
	return p.Err()
}

// maxAnswer bounds one answer: a larger one is not kept.
const maxAnswer = 4 << 20

// Cache is an exact-match cache of whole answers. Safe for concurrent use.
type Cache struct {
	cfg         Config
	fingerprint string
	now         func() time.Time

	mu    sync.Mutex
	lru   *list.List // of *entry, most recently used first
	byKey map[string]*list.Element
	bytes int64

	hits, misses, stored prometheus.Counter
	evicted              *prometheus.CounterVec
	size, entries        prometheus.GaugeFunc
}

type entry struct {
	key    string
	pieces []string
	result infer.Result
	at     time.Time
	bytes  int64
}

// New builds a cache for answers of the model with fingerprint.
func New(cfg Config, fingerprint string, now func() time.Time) *Cache {
	c := &Cache{cfg: cfg, fingerprint: fingerprint, now: now, lru: list.New(), byKey: map[string]*list.Element{},
		hits: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "infernode_response_cache_hits_total", Help: "Requests answered from the exact-match response cache.",
		}),
		misses: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "infernode_response_cache_misses_total", Help: "Requests that asked for the response cache and were computed.",
		}),
		stored: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "infernode_response_cache_stored_total", Help: "Answers put in the response cache.",
		}),
		evicted: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "infernode_response_cache_evictions_total", Help: "Answers taken out of the response cache, by reason: size (least recently used, for room) or ttl.",
		}, []string{"reason"}),
	}
	c.size = prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "infernode_response_cache_bytes", Help: "Bytes of answers in the response cache.",
	}, func() float64 {
		c.mu.Lock()
		defer c.mu.Unlock()
		return float64(c.bytes)
	})
	c.entries = prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "infernode_response_cache_entries", Help: "Answers in the response cache.",
	}, func() float64 {
		c.mu.Lock()
		defer c.mu.Unlock()
		return float64(c.lru.Len())
	})
	return c
}

// Collectors are the cache's metrics.
func (c *Cache) Collectors() []prometheus.Collector {
	return []prometheus.Collector{c.hits, c.misses, c.stored, c.evicted, c.size, c.entries}
}

// Cacheable reports whether req's answer may come from, and go to, the cache.
func Cacheable(req infer.Request) bool {
	return req.CacheAnswer && req.Temperature == 0 && !req.PrefillOnly && !req.PromptLogprobs &&
		len(req.Continue) == 0 && req.Answered == "" && len(req.Messages) == 0
}

// key is the hash of everything in req that shapes its answer.
func (c *Cache) key(req infer.Request) string {
	k := struct {
		Fingerprint, Share, Prompt, Schema string
		Tokens                             []int32
		MaxTokens                          int
		Stop                               []string
		Logprobs                           bool
		TopLogprobs                        int
		Sampling                           infer.Sampling
	}{c.fingerprint, req.Share, req.Prompt, req.Schema, req.Tokens, req.MaxTokens, req.Stop, req.Logprobs, req.TopLogprobs, req.Sampling}
	b, _ := json.Marshal(k)
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

// Serve answers req from the cache when it holds its answer; otherwise it calls submit,
// and keeps the answer if it completes. Requests the cache does not take (see
// Cacheable), and every request when the cache is off, go to submit unchanged.
func (c *Cache) Serve(req infer.Request, submit func() (infer.Stream, error)) (infer.Stream, error) {
	if c == nil || c.cfg.MaxBytes <= 0 || !Cacheable(req) {
		return submit()
	}
	key := c.key(req)
	if e, ok := c.get(key); ok {
		c.hits.Inc()
		return &replay{pieces: e.pieces, result: e.result}, nil
	}
	c.misses.Inc()
	st, err := submit()
	if err != nil {
		return nil, err
	}
	return &recorder{Stream: st, done: func(pieces []string, res infer.Result) { c.put(key, pieces, res) }}, nil
}

func (c *Cache) get(key string) (*entry, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	el, ok := c.byKey[key]
	if !ok {
		return nil, false
	}
	e := el.Value.(*entry)
	if c.now().Sub(e.at) >= c.cfg.TTL {
		c.remove(el, "ttl")
		return nil, false
	}
	c.lru.MoveToFront(el)
	return e, true
}

// put keeps a completed answer, evicting the least recently used (and expired ones met on
// the way) for room.
func (c *Cache) put(key string, pieces []string, res infer.Result) {
	size := int64(len(key))
	for _, p := range pieces {
		size += int64(len(p)) + 16
	}
	for _, lp := range res.Logprobs {
		size += int64(len(lp.Token)) + 24
		for _, t := range lp.Top {
			size += int64(len(t.Token)) + 24
		}
	}
	if size > maxAnswer || size > c.cfg.MaxBytes {
		return
	}
	e := &entry{key: key, pieces: pieces, result: res, at: c.now(), bytes: size}
	c.mu.Lock()
	defer c.mu.Unlock()
	if el, ok := c.byKey[key]; ok {
		c.remove(el, "")
	}
	for c.bytes+size > c.cfg.MaxBytes {
		oldest := c.lru.Back()
		reason := "size"
		if c.now().Sub(oldest.Value.(*entry).at) >= c.cfg.TTL {
			reason = "ttl"
		}
		c.remove(oldest, reason)
	}
	c.byKey[key] = c.lru.PushFront(e)
	c.bytes += size
	c.stored.Inc()
}

// remove takes el out, counted under reason (none: replaced). Callers hold mu.
func (c *Cache) remove(el *list.Element, reason string) {
	e := el.Value.(*entry)
	c.lru.Remove(el)
	delete(c.byKey, e.key)
	c.bytes -= e.bytes
	if reason != "" {
		c.evicted.WithLabelValues(reason).Inc()
	}
}

// recorder passes a computed answer on and keeps it once it completes.
type recorder struct {
	infer.Stream
	pieces []string
	done   func(pieces []string, res infer.Result)
}

func (r *recorder) Recv() (string, error) {
	text, err := r.Stream.Recv()
	switch {
	case err == nil:
		r.pieces = append(r.pieces, text)
	case errors.Is(err, io.EOF):
		if res := r.Stream.Result(); res.Err == nil && res.FinishReason != "" && r.done != nil {
			res.Queued, res.FirstToken, res.Total = 0, 0, 0
			r.done(r.pieces, res)
		}
		r.done = nil
	}
	return text, err
}

// Continuation passes on the computed stream's tokens (a hop resumes from them).
func (r *recorder) Continuation(from int) ([]int32, int, bool) {
	if c, ok := r.Stream.(interface {
		Continuation(int) ([]int32, int, bool)
	}); ok {
		return c.Continuation(from)
	}
	return nil, 0, false
}

// replay is a cached answer, streamed as it was: every prompt token cached, from the
// response cache.
type replay struct {
	pieces []string
	next   int
	result infer.Result
	mu     sync.Mutex
}

func (r *replay) Recv() (string, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.next == len(r.pieces) {
		return "", io.EOF
	}
	r.next++
	return r.pieces[r.next-1], nil
}

func (r *replay) Result() infer.Result {
	res := r.result
	res.CachedTokens, res.FromCache = res.PromptTokens, true
	return res
}

func (r *replay) Admitted() (int, int, bool) {
	return r.result.PromptTokens, r.result.PromptTokens, true
}
func (r *replay) Source() infer.Origin { return infer.ResponseCache }

func (r *replay) Tokens() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.next == len(r.pieces) {
		return r.result.CompletionTokens
	}
	return min(r.next, r.result.CompletionTokens)
}

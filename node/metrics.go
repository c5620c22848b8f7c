package node

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/infernode/infernode/session/infer"
)

// metrics are a node's Prometheus metrics, on a registry of their own (no global state:
// two Servers in one process do not collide).
type metrics struct {
	reg           *prometheus.Registry
	requests      *prometheus.CounterVec   // endpoint, status
	ttft          *prometheus.HistogramVec // endpoint
	itl           prometheus.Histogram
	cancellations *prometheus.CounterVec // cause
	turns         *prometheus.CounterVec // cache: warm, cold
	panics        prometheus.Counter
	capped        prometheus.Counter // connections refused by the per-IP cap
}

// Causes of cancellation, as labels.
const (
	causeClientGone   = "client_disconnect"
	causeWriteTimeout = "write_timeout"
	causeDeadline     = "deadline"
	causeShutdown     = "shutdown"
)

func newMetrics(stats func() infer.Stats) *metrics {
	m := &metrics{
		reg: prometheus.NewRegistry(),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "infernode_http_requests_total", Help: "HTTP requests by endpoint and status.",
		}, []string{"endpoint", "status"}),
		ttft: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "infernode_time_to_first_token_seconds", Help: "Time from request arrival to its first generated text.",
			Buckets: prometheus.ExponentialBuckets(0.005, 2, 14), // 5ms .. 41s
		}, []string{"endpoint"}),
		itl: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "infernode_inter_token_latency_seconds", Help: "Time between successive pieces of generated text of a request.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 12), // 1ms .. 2s
		}),
		cancellations: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "infernode_cancellations_total", Help: "Generations canceled before they finished, by cause.",
		}, []string{"cause"}),
	}
	m.panics = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "infernode_handler_panics_total", Help: "Panics recovered in HTTP handlers (each answered 500 and logged with its stack).",
	})
	m.capped = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "infernode_connections_capped_total", Help: "Connections refused (429) because their address held --max-conns-per-ip already.",
	})
	m.turns = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "infernode_followup_turns_total",
		Help: "Chat turns after an earlier answer entering here, by whether the node serving them found their conversation's KV (warm) or prefilled it all (cold).",
	}, []string{"cache"})
	m.turns.WithLabelValues("warm")
	m.turns.WithLabelValues("cold")
	for _, cause := range []string{causeClientGone, causeWriteTimeout, causeDeadline, causeShutdown} {
		m.cancellations.WithLabelValues(cause)
	}
	gauge := func(name, help string, f func(infer.Stats) float64) prometheus.Collector {
		return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help}, func() float64 { return f(stats()) })
	}
	counter := func(name, help string, f func(infer.Stats) float64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help}, func() float64 { return f(stats()) })
	}
	m.reg.MustRegister(
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		m.requests, m.ttft, m.itl, m.cancellations, m.turns, m.panics, m.capped,
		gauge("infernode_running_sequences", "Requests being prefilled or decoded.", func(s infer.Stats) float64 { return float64(s.Running) }),
		gauge("infernode_waiting_requests", "Requests queued for a sequence, parked ones included.", func(s infer.Stats) float64 { return float64(s.Waiting) }),
		gauge("infernode_cached_conversations", "Idle conversations with cached KV (in the pool or in host memory), replicas included.", func(s infer.Stats) float64 { return float64(s.Conversations) }),
		gauge("infernode_prefill_tokens_per_second", "Prompt tokens prefilled a second at the recent load (gossiped: peers decide from it whether to move a conversation's KV here or let it be recomputed).",
			func(s infer.Stats) float64 { return s.PrefillRate }),
		gauge("infernode_kv_replicas", "Replicas held: copies of other nodes' conversations, kept for their failover.", func(s infer.Stats) float64 { return float64(s.Replicas) }),
		gauge("infernode_kv_cells_used", "KV cache cells holding tokens.", func(s infer.Stats) float64 { return float64(s.KVUsed) }),
		gauge("infernode_kv_cells_active", "KV cache cells held by running requests (the autoscaler's KV input; idle conversations' cells may be evicted).", func(s infer.Stats) float64 { return float64(s.KVActive) }),
		gauge("infernode_kv_cells_total", "KV cache cells.", func(s infer.Stats) float64 { return float64(s.KVCells) }),
		gauge("infernode_kv_host_tokens", "Tokens of idle conversations whose KV cells are in host memory, out of the pool, until their next turn.", func(s infer.Stats) float64 { return float64(s.HostTokens) }),
		counter("infernode_kv_host_moves_total", "Idle conversations whose KV cells were moved out of the pool to host memory (cells every decoded token would read).", func(s infer.Stats) float64 { return float64(s.HostMoves) }),
		counter("infernode_prompt_tokens_total", "Prompt tokens of admitted requests.", func(s infer.Stats) float64 { return float64(s.PromptTokens) }),
		counter("infernode_reused_prefix_tokens_total", "Prompt tokens served from a conversation's KV cache instead of prefilled.", func(s infer.Stats) float64 { return float64(s.ReusedTokens) }),
		counter("infernode_shared_prefix_tokens_total", "Prompt tokens served from the KV cells of another conversation that began the same way (a system prompt, a shared document) instead of prefilled.", func(s infer.Stats) float64 { return float64(s.SharedTokens) }),
		counter("infernode_generated_tokens_total", "Generated tokens.", func(s infer.Stats) float64 { return float64(s.Generated) }),
		counter("infernode_evictions_total", "Idle conversations evicted to make room.", func(s infer.Stats) float64 { return float64(s.Evictions) }),
		counter("infernode_preemptions_total", "Batch requests (service_tier flex) parked, their KV copied out, to make room for interactive ones.", func(s infer.Stats) float64 { return float64(s.Preemptions) }),
		gauge("infernode_parked_requests", "Batch requests parked now, to resume where they stopped (counted in infernode_waiting_requests too).", func(s infer.Stats) float64 { return float64(s.Parked) }),
		counter("infernode_engine_refused_total", "Requests the engine refused as overloaded.", func(s infer.Stats) float64 { return float64(s.Refused) }),
		counter("infernode_decode_steps_total", "Engine steps (llama_decode calls).", func(s infer.Stats) float64 { return float64(s.Steps) }),
		counter("infernode_decode_seconds_total", "Time spent in llama_decode over all steps (its rate is the share of time the engine computes).", func(s infer.Stats) float64 { return float64(s.StepTimeMicros) / 1e6 }),
		counter("infernode_decoded_tokens_total", "Tokens decoded over all steps: prompt tokens prefilled and one a generated token.", func(s infer.Stats) float64 { return float64(s.BatchedTokens) }),
	)
	return m
}

func (m *metrics) request(endpoint string, status int) {
	m.requests.WithLabelValues(endpoint, strconv.Itoa(status)).Inc()
}

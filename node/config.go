package node

import (
	"log/slog"
	"net"
	"time"

	"github.com/infernode/infernode/internal/validate"
	"github.com/infernode/infernode/node/anomaly"
)

// Config configures a Server. Build one with DefaultConfig and change what you need.
type Config struct {
	// ID names this node in responses (X-Infernode-Node) and logs. Required.
	ID string
	// Addr is the HTTP listen address, such as ":8080". Ignored when Listener is set.
	Addr string
	// Listener, if not nil, is used instead of listening on Addr (tests hand in port 0
	// listeners or in-memory ones).
	Listener net.Listener
	// ModelName is the model id clients name in requests and /v1/models lists. Required.
	ModelName string
	// APIKey, if set, must be presented as "Authorization: Bearer KEY" on /v1/*: the key of
	// the default tenant (see tenants.go).
	APIKey string
	// KeyFile, if set, holds further API keys, one "KEY TENANT" a line: each names its
	// tenant. Server.ReloadKeys reads it again (cmd/infernode does on SIGHUP).
	KeyFile string
	// LimitsFile, if set, holds tenants' rate limits (see quota.Load), the same on every
	// node; ReloadKeys reads it again.
	LimitsFile string
	// DefaultMaxTokens is what a request that sets no max_tokens is charged against its
	// tenant's tokens a minute at admission (the engine's default). 0: MaxTokens.
	DefaultMaxTokens int
	// AdminKey, if set, is the operator's key: the only one /v1/cluster, /v1/events and
	// /metrics accept. Without it they take the default tenant's key (APIKey), never a
	// key file's.
	AdminKey string
	// IDKey signs the ids of stored responses (see idMinter); every node of a cluster
	// needs the same one. cmd/infernode derives it from the cluster secret. Nil: a fixed
	// key, for nodes without a secret.
	IDKey []byte
	// MetricsOpen serves /metrics without a key (Prometheus scrapers often carry
	// none). Health probes are always open: peers and orchestrators must reach them.
	// Default false: with an API key set, /metrics requires it.
	MetricsOpen bool
	// MaxBodyBytes refuses larger request bodies with 413. Default 4 MiB.
	MaxBodyBytes int
	// MaxKVBytes refuses larger KV frames (a conversation's cache pushed by a peer) with
	// 413. Default 64 MiB: 2,800 tokens of a 135M model at f16.
	MaxKVBytes int
	// MaxConns bounds the connections the node serves at once (each holds a goroutine and
	// buffers); more wait to be accepted. Default 4096.
	MaxConns int
	// MaxConnsPerIP, if positive, caps the connections open at once from one client
	// address (cluster members exempt); more are answered 429 and closed. Off by default:
	// behind a load balancer every client shares its address.
	MaxConnsPerIP int
	// KVImports bounds the KV frames peers push that are installed at once; more are
	// refused as busy (the sender's conversation is then recomputed). Default 2.
	KVImports int
	// MaxFeeds bounds the event feeds (GET /v1/events) open at once. Default 16.
	MaxFeeds int
	// MaxTokens is the largest max_tokens a request may ask for. Default 8192.
	MaxTokens int
	// MaxStreams is how many generation requests may be in flight on this node, served
	// here or forwarded to their owners; more are refused with 503 at once. It bounds the
	// node's memory and sockets: the engine's own queue limit decides when this node is
	// too busy to serve, and then requests spill to other owners. Default 1024.
	MaxStreams int
	// RequestTimeout bounds a generation request from arrival to its last byte.
	// Default 10m.
	RequestTimeout time.Duration
	// WriteTimeout is how long one write to a client may block. A client that stays
	// behind longer is disconnected and its generation canceled. Default 10s.
	WriteTimeout time.Duration
	// StreamBuffer is the kernel send buffer of a streaming response's connection, in
	// bytes: with the engine's own per-stream text buffer, it bounds how far a client may
	// fall behind before writes block and WriteTimeout starts counting. Default 64 KiB.
	StreamBuffer int
	// ReadTimeout bounds reading a request's headers and body. Default 30s.
	ReadTimeout time.Duration
	// IdleTimeout closes keep-alive connections idle this long. Default 2m.
	IdleTimeout time.Duration
	// DrainTimeout is how long a shutdown lets running requests finish before canceling
	// them. Default 30s.
	DrainTimeout time.Duration
	// Anomaly configures latency alerts (rolling z-scores of this node's first-token and
	// inter-token times against its own past).
	Anomaly anomaly.Config
	// Logger receives the server's logs. Nil means slog.Default().
	Logger *slog.Logger
}

// DefaultConfig returns the limits infernode runs with unless told otherwise.
func DefaultConfig() Config {
	return Config{
		Addr:           ":8080",
		MaxBodyBytes:   4 << 20,          // ~1M tokens of text: far past any context
		MaxKVBytes:     64 << 20,         // the whole context of a small model's conversation
		MaxConns:       4096,             // a goroutine and 8 KiB of buffers each
		KVImports:      2,                // an import holds the frame and stalls the engine briefly
		MaxFeeds:       16,               // dashboards and operators, not clients
		MaxTokens:      8192,             // the default context
		MaxStreams:     1024,             // a goroutine and a socket each; the engine queue sheds load
		RequestTimeout: 10 * time.Minute, // a long generation on a slow CPU
		WriteTimeout:   10 * time.Second, // a client this far behind is gone or hostile
		StreamBuffer:   64 << 10,         // thousands of tokens of SSE
		ReadTimeout:    30 * time.Second, // slowloris bound
		IdleTimeout:    2 * time.Minute,  // keep-alive for clients and peer pools
		DrainTimeout:   30 * time.Second, // most answers finish well within this
		Anomaly:        anomaly.DefaultConfig(),
	}
}

// Validate reports every problem with c at once.
func (c Config) Validate() error {
	p := validate.New("")
	check := p.Check
	check(c.ID != "", "node id is required")
	check(c.Addr != "" || c.Listener != nil, "listen address is required")
	check(c.ModelName != "", "model name is required")
	check(c.MaxBodyBytes >= 1024, "max body bytes must be at least 1024, got %d", c.MaxBodyBytes)
	check(c.MaxKVBytes >= 1024, "max KV frame bytes must be at least 1024, got %d", c.MaxKVBytes)
	check(c.MaxTokens >= 1, "max tokens must be at least 1, got %d", c.MaxTokens)
	check(c.StreamBuffer >= 4096, "stream buffer must be at least 4096 bytes, got %d", c.StreamBuffer)
	check(c.MaxStreams >= 1, "max streams must be at least 1, got %d", c.MaxStreams)
	check(c.MaxConnsPerIP >= 0, "max connections per IP must not be negative, got %d", c.MaxConnsPerIP)
	check(c.MaxConns >= 1 && c.KVImports >= 1 && c.MaxFeeds >= 1, "max connections, KV imports and feeds must be at least 1, got %d, %d and %d",
		c.MaxConns, c.KVImports, c.MaxFeeds)
	p.Positive("request timeout", c.RequestTimeout)
	p.Positive("write timeout", c.WriteTimeout)
	p.Positive("read timeout", c.ReadTimeout)
	p.Positive("idle timeout", c.IdleTimeout)
	p.Positive("drain timeout", c.DrainTimeout)
	if err := c.Anomaly.Validate(); err != nil {
		p.Check(false, "%v", err)
	}
	return p.Err()
}

package routing

import (
	"context"
	"log/slog"
	"net/http"
	"time"

	"github.com/infernode/infernode/internal/validate"
	"github.com/infernode/infernode/node/answers"
	"github.com/infernode/infernode/node/gray"
	"github.com/infernode/infernode/node/kvmove"
	"github.com/infernode/infernode/node/scale"
	"github.com/infernode/infernode/node/stored"
	"github.com/infernode/infernode/ring"
)

// Config configures a node's routing. Build one with DefaultConfig and set the required
// fields.
type Config struct {
	// Self is this node's stable id. Required.
	Self string
	// HTTPAddr is the host:port peers use to reach this node's API. Required.
	HTTPAddr string
	// Fingerprint identifies the model and KV layout; only peers with the same one share
	// a ring. Required.
	Fingerprint string
	// Model is the model id clients name; it travels on the hop so the owner can check it.
	// Required.
	Model string
	// Secret authenticates hops (see Sign). Required unless Insecure: a clustered node
	// without one would serve anyone who can reach its port.
	Secret []byte
	// AcceptSecrets are further keys whose signatures are accepted (never used to sign):
	// during a rotation, the old or the new secret.
	AcceptSecrets [][]byte
	// Insecure lets hops travel unsigned when Secret is empty. For trusted test networks
	// only.
	Insecure bool
	// MaxSkew is the largest difference between a hop's timestamp and this node's clock
	// that is accepted; nonces are remembered this long, so a captured hop cannot be
	// replayed. Default 30s.
	MaxSkew time.Duration
	// ProbeInterval is how often peers' /readyz are checked. Default 500ms.
	ProbeInterval time.Duration
	// ProbePeers bounds the peers checked each ProbeInterval. A cluster of that many
	// peers or fewer has every one checked each time; a larger one has this node's ring
	// neighbours checked each time, then peers not healthy yet (or no longer), then the
	// rest in turn, and gossip's failure detection stands in for checks between turns.
	// Default 32.
	ProbePeers int
	// ProbeTimeout bounds one check. Default 600ms: a check on a fresh connection takes
	// two one-way trips out (the SYN, then the request), so a link that delays packets by
	// 200ms (±20ms jitter) needs about 400-460ms, and a slow link must not look like a dead
	// peer (the chaos suite's slow-link scenario failed at 300ms). The price: a peer that
	// answers nothing (paused, cut off) is off the ring after 3 rounds of up to this long,
	// about 2-2.5s instead of 1.5-2s; a dead process refuses at once.
	ProbeTimeout time.Duration
	// ConnectTimeout bounds dialing a peer (the default transport only). Default 1s.
	ConnectTimeout time.Duration
	// HeaderTimeout bounds waiting for a forwarded request's response headers (the owner
	// answers with its first token, or after KeepAlive if it has none yet). Default 10s.
	HeaderTimeout time.Duration
	// KeepAlive is how often an owner tells the entry node it is still working on a
	// request that has produced no token yet (queued, or prefilling). Default 2s.
	KeepAlive time.Duration
	// ProgressTimeout is the longest silence the entry node accepts on a forwarded answer
	// after its headers: a longer one fails the owner (the request goes to the next
	// owner, or resumes there mid-stream). Default 15s.
	ProgressTimeout time.Duration
	// MaxLine caps one line of a hop's answer stream; a longer one fails the stream as a
	// broken owner. Default 1 MiB.
	MaxLine int
	// KV configures the movement of conversations' KV caches between nodes.
	KV kvmove.Config
	// Scale configures the autoscaling controller (see node/scale); ScaleHook, if set, is
	// called (in a goroutine of its own) with the ring's node count and the count wanted,
	// on the one node that owns the autoscaling key, when they differ.
	Scale     scale.Config
	ScaleHook func(ctx context.Context, current, desired int)
	// Stored configures the Responses API's stored responses (kept like KV: on the owner
	// and its heirs).
	Stored stored.Config
	// Answers bounds the exact-match response cache (see node/answers).
	Answers answers.Config
	// Gray sets how peers that answer, slowly, are found and avoided (see gray).
	Gray gray.Config
	// Role is what this node does (see prefill.go): RoleBoth (the default) owns
	// conversations and prefills their prompts; RoleDecode owns them and has a prefill
	// node prefill a long uncached prompt when that costs it less; RolePrefill owns none
	// and prefills for the others.
	Role string
	// SharePrefixes gossips a digest of the prompt beginnings this node holds, and pulls
	// a new conversation's beginning from a peer whose digest shows it (see prefix.go).
	SharePrefixes bool
	// Candidates is how many ring owners a request may try. Default 3.
	Candidates int
	// PlaceMargin is how many more requests (running and queued) than another candidate an
	// owner may have before it declines a turn for it: a conversation it holds no KV of,
	// for the least loaded candidate; one it holds as its own, for a candidate that took
	// its last replica; and how many more a node it placed a conversation on may have
	// before it takes the conversation back (see Router.Place). 0 turns placement by load
	// off: the owner serves every conversation it can. Default 0 (see docs/BENCHMARKS.md
	// for what 2 does).
	PlaceMargin int
	// DefaultMaxTokens is the engine's token limit for requests that set none, needed to
	// resume such a request elsewhere. Required.
	DefaultMaxTokens int
	// QueueCap is the engine's queue size, gossiped so peers spill over when it is full.
	QueueCap int
	// Ring shapes the ring and the health hysteresis.
	Ring ring.Config
	// Transport carries hops and probes. Nil means an http.Transport with ConnectTimeout.
	Transport http.RoundTripper
	// Clock times probes, header deadlines and hop timestamps. Nil means the real clock.
	Clock Clock
	// Logger receives routing logs. Nil means slog.Default().
	Logger *slog.Logger
}

// DefaultConfig returns infernode's routing settings.
func DefaultConfig() Config {
	return Config{
		MaxSkew:         30 * time.Second,       // clocks of one cluster agree far better; replays older than this fail
		ProbeInterval:   500 * time.Millisecond, // 3 failures: a dead peer is off the ring in ~1.5s
		ProbeTimeout:    600 * time.Millisecond, // see ProbeTimeout
		ProbePeers:      32,                     // 64 checks a second a node at any size; every peer checked at least every 15s at 1,000
		ConnectTimeout:  time.Second,            // a LAN connect takes under a millisecond; a refused one fails at once
		HeaderTimeout:   10 * time.Second,       // the owner answers within KeepAlive, however long its queue
		KeepAlive:       2 * time.Second,        // cheap, and well inside ProgressTimeout
		ProgressTimeout: 15 * time.Second,       // far above a token's time or a keep-alive's; a stalled owner costs its clients this
		MaxLine:         1 << 20,                // one token's text is a few bytes; an error message a few KiB
		Role:            RoleBoth,               // prefill and decode what it owns
		SharePrefixes:   true,                   // a beginning held in the cluster is prefilled once
		Candidates:      3,                      // the owner and two successors
		Ring:            ring.DefaultConfig(),
		KV:              kvmove.DefaultConfig(),
		Stored:          stored.DefaultConfig(),
		Answers:         answers.DefaultConfig(),
		Scale:           scale.DefaultConfig(),
		Gray:            gray.DefaultConfig(),
	}
}

// WANConfig returns DefaultConfig with peer checks paced for peers a WAN apart (round trips
// of up to a few hundred milliseconds, congested links): an unreachable peer is off the
// ring in about 6 s instead of 1.5 s, and a slow link is not mistaken for a dead one.
func WANConfig() Config {
	c := DefaultConfig()
	c.ProbeInterval = 2 * time.Second  // 3 failures: off the ring in ~6s; gossip's own WAN detection takes longer
	c.ProbeTimeout = time.Second       // a few round trips, and a queue behind them
	c.ConnectTimeout = 3 * time.Second // a SYN lost on a congested link is resent after 1s, then 2s
	return c
}

// Validate reports every problem with c at once.
func (c Config) Validate() error {
	p := validate.New("")
	check := p.Check
	check(c.Self != "", "self id is required")
	check(c.HTTPAddr != "", "HTTP address is required")
	check(c.Fingerprint != "", "model fingerprint is required")
	for _, err := range []error{c.Scale.Validate(), c.Answers.Validate()} {
		if err != nil {
			check(false, "%v", err)
		}
	}
	check(c.Model != "", "model name is required")
	check(len(c.Secret) > 0 || c.Insecure, "a cluster secret is required (or run insecure, on a trusted network only)")
	for _, k := range append([][]byte{c.Secret}, c.AcceptSecrets...) {
		check(len(c.Secret) == 0 || len(k) >= 16, "hop keys must be at least 16 bytes, got %d", len(k))
	}
	p.Positive("max skew", c.MaxSkew)
	p.Positive("probe interval", c.ProbeInterval)
	p.Positive("probe timeout", c.ProbeTimeout)
	p.Positive("connect timeout", c.ConnectTimeout)
	p.Positive("header timeout", c.HeaderTimeout)
	p.Positive("keep-alive interval", c.KeepAlive)
	p.Positive("progress timeout", c.ProgressTimeout)
	check(c.KeepAlive < c.HeaderTimeout && c.KeepAlive < c.ProgressTimeout,
		"keep-alive interval (%v) must be below the header timeout (%v) and the progress timeout (%v)", c.KeepAlive, c.HeaderTimeout, c.ProgressTimeout)
	// A round of checks waits for its slowest: a timeout above the interval delays the
	// next round, so bound it to keep every peer checked at least every two intervals.
	check(c.ProbeTimeout <= 2*c.ProbeInterval, "probe timeout (%v) must be at most twice the probe interval (%v)", c.ProbeTimeout, c.ProbeInterval)
	check(c.MaxLine >= 4096, "max line must be at least 4096 bytes, got %d", c.MaxLine)
	check(c.Candidates >= 1, "candidates must be at least 1, got %d", c.Candidates)
	check(c.PlaceMargin >= 0, "place margin must not be negative, got %d", c.PlaceMargin)
	check(c.Role == RoleBoth || c.Role == RoleDecode || c.Role == RolePrefill, "role must be both, decode or prefill, got %q", c.Role)
	check(c.ProbePeers >= 1, "probe peers must be at least 1, got %d", c.ProbePeers)
	check(c.DefaultMaxTokens >= 1, "default max tokens must be at least 1, got %d", c.DefaultMaxTokens)
	check(c.QueueCap >= 0, "queue capacity must not be negative, got %d", c.QueueCap)
	err := c.Ring.Validate()
	check(err == nil, "ring: %w", err)
	err = c.KV.Validate()
	check(err == nil, "%w", err)
	err = c.Gray.Validate()
	check(err == nil, "%w", err)
	return p.Err()
}

// Clock is the time source of routing: tests inject a fake one.
type Clock interface {
	Now() time.Time
	// AfterFunc calls f in its own goroutine after d, unless stopped first.
	AfterFunc(d time.Duration, f func()) Timer
}

// Timer is a pending AfterFunc.
type Timer interface {
	// Stop prevents the call; it reports whether it did.
	Stop() bool
}

type realClock struct{}

func (realClock) Now() time.Time                            { return time.Now() }
func (realClock) AfterFunc(d time.Duration, f func()) Timer { return time.AfterFunc(d, f) }

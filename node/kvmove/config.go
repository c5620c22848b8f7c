package kvmove

import (
	"log/slog"
	"time"

	"github.com/infernode/infernode/internal/validate"
)

// Config configures KV movement. Build one with DefaultConfig.
type Config struct {
	// Transfers is how many KV pushes to peers may run at once. Default 2.
	Transfers int
	// Timeout bounds one KV push. Default 60s.
	Timeout time.Duration
	// Bandwidth bounds the KV pushes of this node together, in megabits a second; 0
	// leaves them unbounded. Default 800.
	Bandwidth float64
	// Margin is how much sooner a transfer must be expected to finish than the
	// destination would prefill the conversation's tokens, for a conversation to move by
	// transfer rather than be recomputed there. Default 1.25.
	Margin float64
	// Replicas is how many other nodes keep a copy of a conversation's KV after each of
	// its turns, for when its owner fails: the node that would take it over, then the one
	// after it. 0 turns replication off. Default 1.
	Replicas int
	// Settle is how long a ring must be quiet before the conversations this node no longer
	// owns are handed to their new owners (a join comes with a short burst of changes).
	// Default 300ms.
	Settle time.Duration
	// Logger receives KV movement logs. Nil means slog.Default().
	Logger *slog.Logger
}

// MaxReplicas bounds Config.Replicas: every replica is a whole copy of the state.
const MaxReplicas = 3

// DefaultConfig returns infernode's KV movement settings.
func DefaultConfig() Config {
	return Config{
		Transfers: 2,                      // a transfer saturates a LAN link or a core; serving keeps the rest
		Timeout:   60 * time.Second,       // 64 MiB at 10 Mbit/s would take longer: then recomputing is cheaper
		Bandwidth: 800,                    // of a gigabit link, a fifth stays for serving and gossip
		Margin:    1.25,                   // the estimates are moving averages; an import also stalls the destination briefly
		Replicas:  1,                      // a crash costs its conversations a transfer, not a prefill
		Settle:    300 * time.Millisecond, // a join's burst of ring changes is over by then
	}
}

// Validate reports every problem with c at once.
func (c Config) Validate() error {
	p := validate.New("")
	check := p.Check
	check(c.Transfers >= 1, "KV transfers must be at least 1, got %d", c.Transfers)
	p.Positive("KV timeout", c.Timeout)
	p.Positive("KV settle time", c.Settle)
	check(c.Bandwidth >= 0, "KV bandwidth must not be negative, got %g", c.Bandwidth)
	check(c.Margin >= 1, "KV margin must be at least 1, got %g", c.Margin)
	check(c.Replicas >= 0 && c.Replicas <= MaxReplicas, "replicas must be between 0 and %d, got %d", MaxReplicas, c.Replicas)
	return p.Err()
}

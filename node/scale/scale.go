// Package scale computes how many nodes a cluster wants, without a coordinator: a PID
// controller on the cluster's queue depth and KV use, read from gossiped load. Every node
// runs one on the same inputs, so every node computes about the same count (a metric that
// Kubernetes autoscalers can read); one node, chosen deterministically (routing picks the
// owner of a fixed key on the ring), fires the scale hook.
//
// The error is how far the busier of two signals is from its set point: requests waiting
// per node against Config.Queue (relative to it), and the share of KV cells held by
// running requests against Config.KV (relative to the room between it and full). The
// output multiplies the current count. Around it: a dead band (an error within it is
// none: no drift on noise), anti-windup (the integral is bounded, and stops growing
// while the output is pinned at the minimum or the maximum), cool-downs (no rise sooner
// than UpCooldown after a change, no fall sooner than DownCooldown), a rise of at most
// double the nodes at a time (a short burst of queue asks for a huge relative
// change: all of it at once overshoots, and the fall after it is a reversal), a fall only
// to the most nodes wanted over the last DownCooldown (Kubernetes' scale-down
// stabilization window: one quiet moment is no reason to shrink), and a floor on
// scale-in: an empty queue says nothing about how many nodes the running requests need,
// so a fall stops at the fewest nodes whose sequence slots the requests in the cluster
// would fill to at most Config.Busy. A ramp up and down reverses at most once; after a
// ring change every node starts again from the ring's size (Follow), so the node that
// takes over the hook does not ask for a count of its own from before.
package scale

import (
	"math"
	"slices"
	"time"

	"github.com/infernode/infernode/internal/validate"
)

// Config configures a controller. Build one with DefaultConfig.
type Config struct {
	Queue        float64       // set point: requests waiting per node. Default 2.
	KV           float64       // set point: the share of KV cells in use. Default 0.85.
	Kp, Ki, Kd   float64       // gains. Defaults 0.5, 0.1, 0.
	DeadBand     float64       // a relative error within it counts as none. Default 0.25.
	Busy         float64       // a scale-in leaves at most this share of sequence slots in use. Default 0.75.
	Min, Max     int           // the node counts it may ask for. Defaults 1 and 16.
	UpCooldown   time.Duration // the least time from a change to a rise. Default 30s.
	DownCooldown time.Duration // the least time from a change to a fall. Default 3m.
}

// DefaultConfig returns infernode's autoscaling settings.
func DefaultConfig() Config {
	return Config{Queue: 2, KV: 0.85, Kp: 0.5, Ki: 0.1, DeadBand: 0.25, Busy: 0.75, Min: 1, Max: 16,
		UpCooldown: 30 * time.Second, DownCooldown: 3 * time.Minute}
}

// Validate reports every problem with c at once.
func (c Config) Validate() error {
	p := validate.New("scale: ")
	p.Check(c.Queue > 0, "queue set point must be above 0, got %g", c.Queue)
	p.Check(c.KV > 0 && c.KV <= 1, "KV set point must be in (0, 1], got %g", c.KV)
	p.Check(c.Kp >= 0 && c.Ki >= 0 && c.Kd >= 0, "gains must not be negative")
	p.Check(c.Busy > 0 && c.Busy <= 1, "busy share must be in (0, 1], got %g", c.Busy)
	p.Check(c.DeadBand >= 0, "dead band must not be negative, got %g", c.DeadBand)
	p.Check(c.Min >= 1 && c.Max >= c.Min, "node counts must satisfy 1 <= min <= max, got %d and %d", c.Min, c.Max)
	return p.Err()
}

// Load is the cluster's load as gossiped: its nodes, the requests running and waiting on
// them and their sequence slots, and their KV cells in use and in all. Running, Waiting
// and KVUsed may be means over the controller's period (see Mean).
type Load struct {
	Nodes                    int
	Running, Waiting, KVUsed float64
	Slots                    int // sequence slots in all (0: unknown, no floor on scale-in)
	KVCells                  int
}

// Mean is the mean of samples, with the last sample's nodes, slots and cells.
func Mean(samples []Load) Load {
	if len(samples) == 0 {
		return Load{}
	}
	m := samples[len(samples)-1]
	m.Running, m.Waiting, m.KVUsed = 0, 0, 0
	for _, s := range samples {
		m.Running += s.Running / float64(len(samples))
		m.Waiting += s.Waiting / float64(len(samples))
		m.KVUsed += s.KVUsed / float64(len(samples))
	}
	return m
}

// Controller is one node's PID controller. It has no clock of its own; it is not safe for
// concurrent use.
type Controller struct {
	cfg      Config
	integral float64
	lastErr  float64
	last     time.Time // of the last update
	changed  time.Time // when desired last changed
	desired  int
	wants    []wanted // the counts wanted over the last DownCooldown, oldest first
	// Error and Output are the last update's, for the dashboard and metrics.
	Error, Output float64
}

// New returns a controller; cfg must be valid.
func New(cfg Config) *Controller { return &Controller{cfg: cfg} }

// Follow takes n, the ring's new size, as the count wanted from now: the change asked
// for has happened (or another node asked for another and it happened), so the
// cool-downs start again from it and the scale-down window forgets what was wanted
// before. Without it, the node that takes over firing the hook after a ring change
// would ask at once for whatever count it last wanted itself.
func (c *Controller) Follow(n int, now time.Time) {
	c.desired, c.changed, c.wants = clamp(n, c.cfg.Min, c.cfg.Max), now, c.wants[:0]
}

// Update takes the cluster's load at now and returns the node count it wants.
func (c *Controller) Update(l Load, now time.Time) int {
	if l.Nodes < 1 {
		return c.desired
	}
	if c.desired == 0 {
		c.desired, c.changed = clamp(l.Nodes, c.cfg.Min, c.cfg.Max), now
	}
	e := l.Waiting/float64(l.Nodes)/c.cfg.Queue - 1
	if l.KVCells > 0 && c.cfg.KV < 1 {
		// KV use is bounded by 1, so its error is measured against the room between the
		// set point and full (1 when full), not against the set point, where even a full
		// cache (1/0.85-1 = 0.18) would stay inside the dead band.
		used := l.KVUsed / float64(l.KVCells)
		e = math.Max(e, math.Max(-1, (used-c.cfg.KV)/(1-c.cfg.KV)))
	}
	if math.Abs(e) < c.cfg.DeadBand {
		e = 0
	}
	dt := 1.0
	if !c.last.IsZero() {
		dt = math.Max(now.Sub(c.last).Seconds(), 1e-3)
	}
	derivative := (e - c.lastErr) / dt
	c.last, c.lastErr = now, e
	integral := math.Max(-2, math.Min(2, c.integral+e*dt/60)) // per minute of error, bounded
	u := c.cfg.Kp*e + c.cfg.Ki*integral + c.cfg.Kd*derivative
	want := clamp(min(int(math.Round(float64(l.Nodes)*(1+u))), 2*l.Nodes), c.cfg.Min, c.cfg.Max)
	if l.Slots > 0 && want < l.Nodes {
		perNode := float64(l.Slots) / float64(l.Nodes)
		need := int(math.Ceil((l.Running + l.Waiting) / (perNode * c.cfg.Busy)))
		want = clamp(max(want, need), c.cfg.Min, l.Nodes)
	}
	c.wants = append(slices.DeleteFunc(c.wants, func(w wanted) bool { return now.Sub(w.at) > c.cfg.DownCooldown }), wanted{now, want})
	// Anti-windup: the integral holds while the output is pinned and the error would push
	// it further.
	pinned := (want == c.cfg.Max && e > 0) || (want == c.cfg.Min && e < 0)
	if !pinned {
		c.integral = integral
	}
	c.Error, c.Output = e, u
	switch {
	case want > c.desired && now.Sub(c.changed) >= c.cfg.UpCooldown:
		c.desired, c.changed = want, now
	case want < c.desired && now.Sub(c.changed) >= c.cfg.DownCooldown:
		most := 0
		for _, w := range c.wants {
			most = max(most, w.n)
		}
		if most < c.desired {
			c.desired, c.changed = most, now
		}
	}
	return c.desired
}

type wanted struct {
	at time.Time
	n  int
}

func clamp(n, lo, hi int) int { return max(lo, min(hi, n)) }

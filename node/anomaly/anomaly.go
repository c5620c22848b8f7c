// Package anomaly raises alerts when a node's own latency leaves its own past: rolling
// z-scores of its first-token and inter-token times, calibrated from its own traffic.
//
// A series (a latency) is cut into buckets of Config.Bucket; each bucket's mean is one
// sample. When a bucket closes, its mean is compared with the means of the Config.Window
// buckets before it: z = (mean - their mean) / their standard deviation (floored at 5%
// of their mean, so that a very steady series does not alert on noise). Past
// Config.Threshold it is an alert, and then none for Config.Cooldown: one bad minute is
// one alert. Nothing alerts until Config.MinBuckets buckets of history are there.
//
// How it differs from gray failure detection (node/gray): gray compares peers with each
// other (probe round trips, token gaps, as every node sees every other), so it finds the
// one slow node of a cluster and routes around it; a z-score compares a node with its own
// past, so it finds a change that hits every node at once (a bad deploy, a noisy
// neighbour on the host, a workload shift), which gray cannot see, and it routes nothing:
// it tells the operator.
package anomaly

import (
	"math"
	"sync"
	"time"

	"github.com/infernode/infernode/internal/validate"
)

// Config configures a detector. Build one with DefaultConfig.
type Config struct {
	Bucket     time.Duration // one sample of a series: the mean over this long. Default 10s.
	Window     int           // buckets of past a bucket is compared with. Default 60 (10 minutes).
	MinBuckets int           // buckets of past needed before alerting. Default 12 (2 minutes).
	MinCount   int           // observations a bucket needs to count. Default 5.
	Threshold  float64       // the z-score that alerts. Default 3.
	Cooldown   time.Duration // the quiet after an alert, per series. Default 5m.
}

// DefaultConfig returns infernode's anomaly settings.
func DefaultConfig() Config {
	return Config{Bucket: 10 * time.Second, Window: 60, MinBuckets: 12, MinCount: 5, Threshold: 3, Cooldown: 5 * time.Minute}
}

// Validate reports every problem with c at once.
func (c Config) Validate() error {
	p := validate.New("anomaly: ")
	p.Positive("bucket", c.Bucket)
	p.Positive("cooldown", c.Cooldown)
	p.Check(c.Window >= 2, "window must be at least 2 buckets, got %d", c.Window)
	p.Check(c.MinBuckets >= 2 && c.MinBuckets <= c.Window, "min buckets must be in [2, window], got %d", c.MinBuckets)
	p.Check(c.MinCount >= 1, "min count must be at least 1, got %d", c.MinCount)
	p.Check(c.Threshold > 0, "threshold must be above 0, got %g", c.Threshold)
	return p.Err()
}

// Alert is a bucket whose mean sat Z standard deviations above its series' past.
type Alert struct {
	Series         string
	Z              float64
	Mean, Baseline float64 // the bucket's mean and the past buckets' mean
	At             time.Time
}

// Detector follows named series. It has no clock of its own and is safe for concurrent use.
type Detector struct {
	cfg    Config
	mu     sync.Mutex
	series map[string]*series
}

type series struct {
	start      time.Time // of the open bucket
	sum        float64
	count      int
	past       []float64 // closed buckets' means, oldest first, at most Window
	lastAlert  time.Time
	z          float64 // of the last closed bucket
	calibrated bool
}

// New returns a detector; cfg must be valid.
func New(cfg Config) *Detector { return &Detector{cfg: cfg, series: map[string]*series{}} }

// Observe adds v to series name at now, and returns the alert of a bucket it closed, if
// that bucket was anomalous.
func (d *Detector) Observe(name string, v float64, now time.Time) *Alert {
	d.mu.Lock()
	defer d.mu.Unlock()
	s := d.series[name]
	if s == nil {
		s = &series{start: now}
		d.series[name] = s
	}
	var alert *Alert
	if now.Sub(s.start) >= d.cfg.Bucket {
		alert = d.close(name, s, now)
	}
	s.sum += v
	s.count++
	return alert
}

// close ends s's open bucket at now. Callers hold mu.
func (d *Detector) close(name string, s *series, now time.Time) *Alert {
	defer func() { s.start, s.sum, s.count = now, 0, 0 }()
	if s.count < d.cfg.MinCount {
		return nil // too few to say anything: not a sample
	}
	mean := s.sum / float64(s.count)
	var alert *Alert
	if len(s.past) >= d.cfg.MinBuckets {
		s.calibrated = true
		mu, sd := meanStd(s.past)
		sd = math.Max(sd, 0.05*mu)
		s.z = (mean - mu) / sd
		if s.z >= d.cfg.Threshold && (s.lastAlert.IsZero() || now.Sub(s.lastAlert) >= d.cfg.Cooldown) {
			s.lastAlert = now
			alert = &Alert{Series: name, Z: s.z, Mean: mean, Baseline: mu, At: now}
		}
	}
	s.past = append(s.past, mean)
	if len(s.past) > d.cfg.Window {
		s.past = s.past[1:]
	}
	return alert
}

// Last is series name's last closed bucket's mean (0 before one).
func (d *Detector) Last(name string) float64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	if s := d.series[name]; s != nil && len(s.past) > 0 {
		return s.past[len(s.past)-1]
	}
	return 0
}

// Z is series name's last closed bucket's z-score (0 until it is calibrated).
func (d *Detector) Z(name string) float64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	if s := d.series[name]; s != nil && s.calibrated {
		return s.z
	}
	return 0
}

func meanStd(xs []float64) (mean, std float64) {
	for _, x := range xs {
		mean += x
	}
	mean /= float64(len(xs))
	for _, x := range xs {
		std += (x - mean) * (x - mean)
	}
	return mean, math.Sqrt(std / float64(len(xs)-1))
}

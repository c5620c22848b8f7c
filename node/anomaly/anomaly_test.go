package anomaly

import (
	"math/rand/v2"
	"testing"
	"time"
)

// TestAlerts: a latency that varies around its level alerts nothing; a jump to several
// times it alerts once (the cool-down), and again once the cool-down has passed; nothing
// alerts before the detector has calibrated.
func TestAlerts(t *testing.T) {
	cfg := DefaultConfig()
	d := New(cfg)
	rng := rand.New(rand.NewPCG(1, 2))
	now := time.Unix(0, 0)
	var alerts []*Alert
	feed := func(d time.Duration, level float64, det *Detector) {
		for end := now.Add(d); now.Before(end); now = now.Add(500 * time.Millisecond) {
			if a := det.Observe("ttft", level*(0.8+0.4*rng.Float64()), now); a != nil {
				alerts = append(alerts, a)
			}
		}
	}
	feed(20*time.Minute, 0.4, d)
	if len(alerts) != 0 || d.Z("ttft") > cfg.Threshold {
		t.Fatalf("a steady series alerted: %+v", alerts)
	}
	feed(3*time.Minute, 1.6, d) // four times slower, for three minutes
	if len(alerts) != 1 || alerts[0].Z < cfg.Threshold || alerts[0].Mean < 1.2 {
		t.Fatalf("three bad minutes: %d alerts %+v, want one", len(alerts), alerts)
	}
	feed(5*time.Minute, 1.6, d) // still slow, past the cool-down: the baseline has moved, or one more alert
	if len(alerts) > 2 {
		t.Fatalf("%d alerts in eight minutes of one slowdown", len(alerts))
	}
	fresh := New(cfg)
	alerts = nil
	feed(time.Minute, 0.4, fresh)
	feed(time.Minute, 4, fresh)
	if len(alerts) != 0 {
		t.Fatalf("alerted before calibrating: %+v", alerts)
	}
}

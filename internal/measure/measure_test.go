package measure

import (
	"testing"
	"time"
)

func TestSteadyRate(t *testing.T) {
	at := func(ms ...int) []time.Time {
		base := time.Unix(0, 0)
		var out []time.Time
		for _, m := range ms {
			out = append(out, base.Add(time.Duration(m)*time.Millisecond))
		}
		return out
	}
	tests := []struct {
		name    string
		events  [][]time.Time
		count   float64
		seconds float64
	}{
		{"one stream", [][]time.Time{at(0, 100, 200, 300)}, 3, 0.3},
		{"overlap only", [][]time.Time{at(0, 100, 200, 300), at(150, 250, 350)}, 3, 0.15}, // 200, 300 and 250 in (150, 300]
		{"no overlap", [][]time.Time{at(0, 100), at(200, 300)}, 0, 0},
		{"too short", [][]time.Time{at(0)}, 0, 0},
	}
	for _, tt := range tests {
		c, s := SteadyRate(tt.events)
		if c != tt.count || (s-tt.seconds) > 1e-9 || (tt.seconds-s) > 1e-9 {
			t.Errorf("%s: SteadyRate = %v, %v; want %v, %v", tt.name, c, s, tt.count, tt.seconds)
		}
	}
}

// GoodputAt takes the highest rate whose attainment at the scale met the goal, not the
// highest goodput: a rate past the knee may still deliver more good requests at a lower
// share.
func TestGoodputAt(t *testing.T) {
	level := func(rate float64, att ...float64) OpenLevel {
		l := OpenLevel{Rate: rate}
		for i, a := range att {
			l.Scaled = append(l.Scaled, Scaled{Scale: float64(i + 1), Attainment: a, Goodput: a * rate})
		}
		return l
	}
	levels := []OpenLevel{level(0.5, 0.95, 1), level(1, 0.8, 0.92), level(2, 0.6, 0.7)}
	for _, c := range []struct {
		scale      int
		goal, want float64
	}{{0, 0.9, 0.5}, {0, 0.75, 1}, {0, 0.5, 2}, {1, 0.9, 1}, {1, 0.5, 2}, {2, 0.5, 0}} {
		g, rate := GoodputAt(levels, c.scale, c.goal)
		if rate != c.want || (rate == 0) != (g == 0) {
			t.Errorf("scale %d, goal %v: rate %v goodput %v, want rate %v", c.scale, c.goal, rate, g, c.want)
		}
	}
}

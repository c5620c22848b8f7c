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

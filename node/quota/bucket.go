package quota

import (
	"math"
	"time"
)

// bucket is a token bucket: it fills at rate a second up to capacity. The zero rate means
// no limit. It has no clock of its own.
type bucket struct {
	rate, capacity float64
	level          float64
	last           time.Time
}

func newBucket(rate, capacity float64, now time.Time) *bucket {
	return &bucket{rate: rate, capacity: capacity, level: capacity, last: now}
}

func (b *bucket) fill(now time.Time) {
	if d := now.Sub(b.last).Seconds(); d > 0 {
		b.level = math.Min(b.capacity, b.level+d*b.rate)
	}
	b.last = now
}

// take takes at least least and at most most (all or nothing of least): it returns what
// it took, or 0 and how long until least is there.
func (b *bucket) take(least, most float64, now time.Time) (float64, time.Duration) {
	b.fill(now)
	if least > b.capacity {
		return 0, time.Duration(math.MaxInt64) // more than the bucket ever holds
	}
	if b.level < least {
		return 0, time.Duration((least - b.level) / b.rate * float64(time.Second))
	}
	got := math.Min(most, b.level)
	b.level -= got
	return got, 0
}

// reset is how long until the bucket is full again.
func (b *bucket) reset(now time.Time) time.Duration {
	b.fill(now)
	return time.Duration((b.capacity - b.level) / b.rate * float64(time.Second))
}

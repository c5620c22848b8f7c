package ring

// Health flips down after DownAfter consecutive failures and up after UpAfter consecutive
// successes. It has no clock: callers feed it one check result at a time.
type Health struct {
	up        bool
	streak    int
	downAfter int
	upAfter   int
}

// NewHealth starts up or down as told, with no streak.
func NewHealth(up bool, downAfter, upAfter int) Health {
	return Health{up: up, downAfter: downAfter, upAfter: upAfter}
}

// Up reports the current state.
func (h *Health) Up() bool { return h.up }

// Observe records one check and reports whether the state flipped.
func (h *Health) Observe(ok bool) (changed bool) {
	if ok == h.up {
		h.streak = 0
		return false
	}
	h.streak++
	need := h.downAfter
	if !h.up {
		need = h.upAfter
	}
	if h.streak < need {
		return false
	}
	h.up, h.streak = ok, 0
	return true
}

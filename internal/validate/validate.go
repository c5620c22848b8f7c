// Package validate collects every problem of a configuration, so a Validate method can
// report them all at once (errors.Join) instead of stopping at the first.
package validate

import (
	"errors"
	"fmt"
	"time"
)

// Problems gathers failed checks. The zero value is ready to use.
type Problems struct {
	prefix string
	errs   []error
}

// New starts a list whose messages begin with prefix (for example "routing: ").
func New(prefix string) *Problems { return &Problems{prefix: prefix} }

// Check records a problem described by format and args unless ok.
func (p *Problems) Check(ok bool, format string, args ...any) {
	if !ok {
		p.errs = append(p.errs, fmt.Errorf(p.prefix+format, args...))
	}
}

// Positive records a problem if the duration called name is not above zero.
func (p *Problems) Positive(name string, d time.Duration) {
	p.Check(d > 0, "%s must be positive, got %v", name, d)
}

// Err is every problem recorded, joined, or nil.
func (p *Problems) Err() error { return errors.Join(p.errs...) }

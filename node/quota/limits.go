package quota

import (
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/infernode/infernode/internal/conffile"
)

// Limit is what a tenant may use of a model. A zero field is no limit.
type Limit struct {
	RPM, TPM float64 // requests and tokens a minute
	// Burst is how many seconds of its rate a bucket holds when full. Default 3: over a
	// minute a tenant gets its rate within 5% (a new bucket starts full).
	Burst float64
	// Concurrent bounds the tenant's requests in flight on each node.
	Concurrent int
	// Batch makes every request of the tenant batch work (see infer.Request.Batch).
	Batch bool
	// CacheAnswers lets every greedy request of the tenant be answered from the owner's
	// response cache (see infer.Request.CacheAnswer).
	CacheAnswers bool
}

// DefaultBurst is Limit.Burst when a limits file says none.
const DefaultBurst = 3

// Limits are the limits of every tenant, by tenant and model ("*" for any).
type Limits map[[2]string]Limit

// Lookup is tenant's limit on model: its own for the model, else its own for any model,
// else every tenant's ("*") for the model, else for any; zero when none is set.
func (l Limits) Lookup(tenant, model string) Limit {
	for _, k := range [][2]string{{tenant, model}, {tenant, "*"}, {"*", model}, {"*", "*"}} {
		if lim, ok := l[k]; ok {
			return lim
		}
	}
	return Limit{}
}

// Load reads a limits file: a line a tenant (or * for every tenant without a line of its
// own; "default" is the tenant of --api-key, or of everyone on a node without keys),
// then key=value settings: rpm, tpm, burst (seconds), concurrent, priority (interactive or
// batch: all its requests are batch work), response_cache (on or off: its greedy requests
// may be answered from the response cache), and model (the line applies to that model
// only). Blank lines and # comments are allowed.
//
//	default  rpm=600 tpm=200000
//	alpha    rpm=60 tpm=20000 concurrent=4
//	beta     model=stories260K rpm=30
//	*        rpm=10
func Load(path string) (Limits, error) {
	out := Limits{}
	err := conffile.Read("limits file", path, func(_ int, f []string) error {
		lim, model := Limit{Burst: DefaultBurst}, "*"
		for _, kv := range f[1:] {
			k, v, ok := strings.Cut(kv, "=")
			if !ok {
				return fmt.Errorf("want key=value, got %q", kv)
			}
			switch k {
			case "model":
				model = v
				continue
			case "priority":
				if v != "batch" && v != "interactive" {
					return fmt.Errorf("priority must be batch or interactive, got %q", v)
				}
				lim.Batch = v == "batch"
				continue
			case "response_cache":
				if v != "on" && v != "off" {
					return fmt.Errorf("response_cache must be on or off, got %q", v)
				}
				lim.CacheAnswers = v == "on"
				continue
			}
			x, err := strconv.ParseFloat(v, 64)
			if err != nil || x < 0 {
				return fmt.Errorf("%s must be a number >= 0, got %q", k, v)
			}
			switch k {
			case "rpm":
				lim.RPM = x
			case "tpm":
				lim.TPM = x
			case "burst":
				lim.Burst = x
			case "concurrent":
				lim.Concurrent = int(x)
			default:
				return fmt.Errorf("unknown setting %q (rpm, tpm, burst, concurrent, priority, response_cache, model)", k)
			}
		}
		if lim.Burst <= 0 {
			return errors.New("burst must be above 0")
		}
		key := [2]string{f[0], model}
		if _, dup := out[key]; dup {
			return fmt.Errorf("tenant %s, model %s listed twice", f[0], model)
		}
		out[key] = lim
		return nil
	})
	return out, err
}

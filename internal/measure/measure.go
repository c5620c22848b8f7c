// Package measure holds the throughput arithmetic that the engine benchmarks and the HTTP
// load generator share, so their numbers mean the same thing, and runs the load generator
// for the commands that compare (cmd/benchcompare, cmd/benchoverhead).
package measure

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"slices"
	"strings"
	"syscall"
	"time"
)

// SteadyRate counts the events of all streams inside the window where every stream is
// between its first and last event (all of them decoding at once), and returns that count
// and the window's length in seconds. Streams that start a little apart, or prefill at
// different times, therefore do not count against the server. It returns 0, 0 when there
// is no such window.
func SteadyRate(events [][]time.Time) (count, seconds float64) {
	var from, to time.Time
	for _, ev := range events {
		if len(ev) < 2 {
			return 0, 0
		}
		if from.IsZero() || ev[0].After(from) {
			from = ev[0]
		}
		if to.IsZero() || ev[len(ev)-1].Before(to) {
			to = ev[len(ev)-1]
		}
	}
	if !to.After(from) {
		return 0, 0
	}
	for _, ev := range events {
		for _, t := range ev {
			if t.After(from) && !t.After(to) {
				count++
			}
		}
	}
	return count, to.Sub(from).Seconds()
}

// Percentile is the p-th percentile (0-100) of d, by the nearest-rank method; 0 when d is
// empty.
func Percentile(d []time.Duration, p int) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	return s[min(len(s)-1, len(s)*p/100)]
}

// Level is one concurrency level of a load-generator run (cmd/loadgen's -json output, read
// by Loadgen).
type Level struct {
	Concurrency int     `json:"concurrency"`
	Requests    int     `json:"requests"`
	Failed      int     `json:"failed"`
	DecodeTokS  float64 `json:"decode_tok_s"`
	TTFTp50ms   float64 `json:"ttft_p50_ms"`
	TTFTp99ms   float64 `json:"ttft_p99_ms"`
	ITLp50ms    float64 `json:"itl_p50_ms"`
	ITLp99ms    float64 `json:"itl_p99_ms"`
	TotalTokens int     `json:"completion_tokens"`
	WallSeconds float64 `json:"wall_s"`
}

// OpenLevel is one request rate of an open-loop load-generator run (cmd/loadgen --rate's
// -json output, read by LoadgenOpen).
type OpenLevel struct {
	Rate      float64 `json:"rate"`          // requests a second asked for
	Achieved  float64 `json:"achieved_rate"` // requests sent a second
	Requests  int     `json:"requests"`
	Failed    int     `json:"failed"`
	PromptP50 int     `json:"prompt_tokens_p50"` // the median request's prompt, as the server counted it
	// Answered is the workload the server answered: the prompt and completion tokens of
	// the requests that did not fail (a prompt's cached tokens count: the unit of work a
	// client asks for, whatever the server reuses).
	Answered  int     `json:"answered_tokens"`
	TTFTp50ms float64 `json:"ttft_p50_ms"`
	TTFTp99ms float64 `json:"ttft_p99_ms"`
	TPOTp50ms float64 `json:"tpot_p50_ms"`
	TPOTp99ms float64 `json:"tpot_p99_ms"`
	ITLp50ms  float64 `json:"itl_p50_ms"`
	ITLp99ms  float64 `json:"itl_p99_ms"`
	// EndWait: from an answer's last token to its stream's end (the finish, usage and
	// [DONE]), which time per output token counts and inter-token gaps do not.
	EndWaitp50ms float64 `json:"end_wait_p50_ms"`
	EndWaitp99ms float64 `json:"end_wait_p99_ms"`
	// Follow-up turns (a conversation's second and later): their first token, and the
	// share of their prompt tokens the server reported cached (-1 when it reported none:
	// ollama does not).
	FollowTTFTp50ms float64  `json:"follow_ttft_p50_ms"`
	FollowTTFTp99ms float64  `json:"follow_ttft_p99_ms"`
	FollowCached    float64  `json:"follow_cached"`
	Resumed         int      `json:"resumed"`        // streams the server resumed on another node
	Attainment      float64  `json:"slo_attainment"` // share of requests meeting both targets
	Goodput         float64  `json:"goodput"`        // requests meeting both a second
	Scaled          []Scaled `json:"scaled,omitempty"`
}

// Request is one request of an open-loop run, as cmd/loadgen --records writes it (a JSON
// object a line).
type Request struct {
	Conversation string    `json:"conversation"`
	Turn         int       `json:"turn"` // 0: the conversation's first
	Start        time.Time `json:"start"`
	TTFTms       float64   `json:"ttft_ms"` // 0: no token came
	Tokens       int       `json:"tokens"`
	PromptTokens int       `json:"prompt_tokens"`
	CachedTokens int       `json:"cached_tokens"`
	Resumed      int       `json:"resumed"`
	Upstream     string    `json:"upstream,omitempty"` // the X-Upstream header: the proxy's backend
	Node         string    `json:"node,omitempty"`     // the X-Infernode-Node header: the node that served it
	Error        string    `json:"error,omitempty"`
}

// Served is the backend that served r: the infernode node that says so, else the proxy's
// backend (the last nginx tried: $upstream_addr lists them all, "a, b").
func (r Request) Served() string {
	if r.Node != "" {
		return r.Node
	}
	return r.Connected()
}

// Connected is the backend the client's answer streamed through: the last one the proxy
// tried.
func (r Request) Connected() string {
	return r.Upstream[strings.LastIndex(r.Upstream, " ")+1:]
}

// ReadRequests reads a --records file.
func ReadRequests(path string) ([]Request, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []Request
	for dec := json.NewDecoder(f); ; {
		var r Request
		if err := dec.Decode(&r); err == io.EOF {
			return out, nil
		} else if err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		out = append(out, r)
	}
}

// Scaled is an open-loop rate measured against its SLO's targets times Scale (both).
type Scaled struct {
	Scale      float64 `json:"scale"`
	Attainment float64 `json:"slo_attainment"`
	Goodput    float64 `json:"goodput"`
}

// LoadgenOpen runs the load generator bin with args (--rate among them) and --json, and
// returns its rates.
func LoadgenOpen(bin string, args ...string) ([]OpenLevel, error) {
	return loadgenJSON[OpenLevel](bin, args)
}

// Loadgen runs the load generator bin with args and --json, and returns its levels.
func Loadgen(bin string, args ...string) ([]Level, error) { return loadgenJSON[Level](bin, args) }

// loadgenJSON runs the load generator bin with args and --json, and decodes its output.
func loadgenJSON[T any](bin string, args []string) ([]T, error) {
	out, err := Output(exec.Command(bin, append(args, "--json")...))
	if err != nil {
		return nil, err
	}
	var levels []T
	if err := json.Unmarshal(out, &levels); err != nil {
		return nil, fmt.Errorf("%s: %q: %w", bin, out, err)
	}
	return levels, nil
}

// Output runs cmd and returns its standard output; a failure carries its standard error.
func Output(cmd *exec.Cmd) ([]byte, error) {
	out, err := cmd.Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			err = fmt.Errorf("%w: %s", err, ee.Stderr)
		}
		return out, fmt.Errorf("%s: %w", cmd.Path, err)
	}
	return out, nil
}

// ContextSwitches is how many times the threads of this process have been switched out so
// far (voluntarily or not; getrusage), for benchmarks to report per step: on a machine
// whose cores llama.cpp's threads fill, each one is a thread of llama.cpp set aside.
func ContextSwitches() int64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return ru.Nvcsw + ru.Nivcsw
}

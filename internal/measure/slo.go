package measure

import (
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"time"
)

// AttainmentGoals are the shares of requests that must meet an SLO for a rate to count
// towards goodput: DistServe's 90%, and 75% and 50%, where a long-tailed workload on a
// small machine still has rates to compare (its longest prompts miss a first-token target
// set by the median prompt even unloaded).
var AttainmentGoals = []float64{0.9, 0.75, 0.5}

// RawSLO runs the session/llama test binary's BenchmarkRawFirstToken (llama.cpp alone, no
// server) for a prompt of the given tokens on model with the servers' threads, and returns
// its first token and its decode step: the SLO that favours no server. raw is the command
// line that runs the binary (a taskset prefix may pin it; pinned, threads must fit the
// cores, or llama.cpp's spinning threads wait on each other).
func RawSLO(model string, prompt, threads int, raw ...string) (ttft, tpot time.Duration, err error) {
	cmd := exec.Command(raw[0], append(raw[1:], "-test.run", "^$", "-test.bench", "RawFirstToken/", "-test.benchtime", "10x")...)
	cmd.Env = append(os.Environ(), "INFERNODE_BENCH_MODEL="+model, fmt.Sprintf("INFERNODE_RAW_PROMPT_TOKENS=%d", prompt),
		fmt.Sprintf("INFERNODE_RAW_THREADS=%d", threads))
	out, err := Output(cmd)
	if err != nil {
		return 0, 0, err
	}
	metric := func(unit string) (time.Duration, error) {
		m := regexp.MustCompile(`([0-9.]+) ` + unit).FindSubmatch(out)
		if m == nil {
			return 0, fmt.Errorf("%s: no %s in %q", raw, unit, out)
		}
		v, err := strconv.ParseFloat(string(m[1]), 64)
		return time.Duration(v * float64(time.Millisecond)), err
	}
	if ttft, err = metric("first-token-ms"); err != nil {
		return 0, 0, err
	}
	tpot, err = metric("step-ms")
	return ttft, tpot, err
}

// GoodputAt is the goodput at SLO scale i (an index into each level's Scaled) of the
// highest rate whose attainment met goal there, and that rate (0, 0 when none did).
func GoodputAt(levels []OpenLevel, i int, goal float64) (goodput, rate float64) {
	for _, l := range levels {
		if i < len(l.Scaled) && l.Scaled[i].Attainment >= goal && l.Rate > rate {
			goodput, rate = l.Scaled[i].Goodput, l.Rate
		}
	}
	return goodput, rate
}

// Command benchcompare measures infernode and ollama side by side on one machine: the same
// GGUF, one node each, the same load generator (cmd/loadgen) against both, alternating
// round by round, and prints one table. make bench-compare builds ollama from the module
// version in go.mod with the same compiler flags and runs this.
//
//	benchcompare --ollama .build/ollama --model models/smollm2-135m-shape.gguf --rounds 2
package main

import (
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/infernode/infernode/internal/measure"
	"github.com/infernode/infernode/internal/poll"
)

// server is one server under test.
type server struct {
	name, url, model string
	cmd              *exec.Cmd
}

func main() {
	infernode := flag.String("infernode", "bin/infernode", "infernode binary")
	ollama := flag.String("ollama", ".build/ollama", "ollama binary (make bench-compare builds it)")
	loadgen := flag.String("loadgen", "bin/loadgen", "loadgen binary")
	model := flag.String("model", "models/smollm2-135m-shape.gguf", "GGUF both servers serve")
	rounds := flag.Int("rounds", 2, "rounds, alternating the servers in each")
	parallel := flag.Int("parallel", 8, "sequences each server runs at once (ollama: OLLAMA_NUM_PARALLEL)")
	extra := flag.String("infernode-args", "", "more infernode flags, space-separated (to compare settings)")
	temperature := flag.Float64("temperature", 0, "sampling temperature of every request (0: greedy)")
	var g goodputConfig
	flag.StringVar(&g.raw, "goodput", "", "goodput mode: the session/llama test binary (go test -c) whose BenchmarkRawFirstToken sets the SLOs; open-loop load instead of waves")
	flag.StringVar(&g.rates, "rates", "0.25,0.5,1,1.5,2,3", "goodput mode: the request rates swept")
	flag.DurationVar(&g.duration, "rate-duration", 60*time.Second, "goodput mode: how long each rate runs")
	flag.Parse()
	if err := run(*infernode, *ollama, *loadgen, *model, *rounds, *parallel, *temperature, strings.Fields(*extra), g); err != nil {
		fmt.Fprintln(os.Stderr, "benchcompare:", err)
		os.Exit(1)
	}
}

func run(infernodeBin, ollamaBin, loadgen, model string, rounds, parallel int, temperature float64, extra []string, g goodputConfig) error {
	model, err := filepath.Abs(model)
	if err != nil {
		return err
	}
	work, err := os.MkdirTemp("", "benchcompare")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)

	inf := &server{name: "infernode", url: "http://127.0.0.1:18581"}
	inf.cmd = exec.Command(infernodeBin, append([]string{"--model", model, "--addr", "127.0.0.1:18581", "--seed", "1",
		"--sequences", fmt.Sprint(parallel), "--log-level", "warn"}, extra...)...)
	oll := &server{name: "ollama serve", url: "http://127.0.0.1:18582", model: "bench"}
	oll.cmd = exec.Command(ollamaBin, "serve")
	oll.cmd.Env = append(os.Environ(), "OLLAMA_HOST=127.0.0.1:18582", "OLLAMA_MODELS="+filepath.Join(work, "models"),
		fmt.Sprintf("OLLAMA_NUM_PARALLEL=%d", parallel), "OLLAMA_KEEP_ALIVE=1h")
	for _, s := range []*server{inf, oll} {
		s.cmd.Stdout, s.cmd.Stderr = nil, nil
		s.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
		if err := s.cmd.Start(); err != nil {
			return fmt.Errorf("start %s: %w", s.name, err)
		}
		defer syscall.Kill(-s.cmd.Process.Pid, syscall.SIGKILL)
	}
	for _, u := range []string{inf.url + "/readyz", oll.url + "/"} {
		if !poll.Answers200(u, time.Minute) {
			return fmt.Errorf("%s did not answer 200 within a minute", u)
		}
	}
	modelfile := filepath.Join(work, "Modelfile")
	if err := os.WriteFile(modelfile, []byte("FROM "+model+"\n"), 0o644); err != nil {
		return err
	}
	create := exec.Command(ollamaBin, "create", oll.model, "-f", modelfile)
	create.Env = append(os.Environ(), "OLLAMA_HOST=127.0.0.1:18582")
	if out, err := create.CombinedOutput(); err != nil {
		return fmt.Errorf("ollama create: %w: %s", err, out)
	}

	// The load: streaming chat, a 32-word prompt, 64 tokens, greedy (or at
	// --temperature); 6 requests one at a time, and 3 waves of 8 at once (loadgen's rounds),
	// a warm-up first.
	// Then the first wave's floor: the same waves of 8 with one token each, so that the last
	// first token of a wave is the time to prefill it with nothing else to do.
	type cell struct{ one, eight, wave measure.Level }
	results := map[string][]cell{}
	for _, s := range []*server{inf, oll} {
		if _, err := loadRun(loadgen, s, temperature, 1, 1, 64); err != nil {
			return fmt.Errorf("warm-up of %s: %w", s.name, err)
		}
	}
	if g.raw != "" {
		return runGoodput(g, loadgen, model, rounds, temperature, inf, oll)
	}
	for r := range rounds {
		for _, s := range []*server{inf, oll} {
			fmt.Fprintf(os.Stderr, "round %d: %s\n", r+1, s.name)
			var c cell
			for _, run := range []struct {
				l                 *measure.Level
				n, rounds, tokens int
			}{{&c.one, 1, 6, 64}, {&c.eight, 8, 3, 64}, {&c.wave, 8, 3, 1}} {
				if *run.l, err = loadRun(loadgen, s, temperature, run.n, run.rounds, run.tokens); err != nil {
					return err
				}
			}
			results[s.name] = append(results[s.name], c)
		}
	}

	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "server\ttok/s, 1 stream\ttok/s, 8 streams\tTTFT p50, 8\tTTFT p99, 8\tITL p50, 8\tITL p99, 8\tdecode tok/s, 8 (steady)\tfailed\t")
	for _, s := range []*server{inf, oll} {
		var cols [8][]string
		failed := 0
		for _, c := range results[s.name] {
			cols[0] = append(cols[0], fmt.Sprintf("%.1f", wallRate(c.one)))
			cols[1] = append(cols[1], fmt.Sprintf("%.1f", wallRate(c.eight)))
			cols[2] = append(cols[2], fmt.Sprintf("%.0f ms", c.eight.TTFTp50ms))
			cols[3] = append(cols[3], fmt.Sprintf("%.0f ms", c.eight.TTFTp99ms))
			cols[4] = append(cols[4], fmt.Sprintf("%.0f ms", c.eight.ITLp50ms))
			cols[5] = append(cols[5], fmt.Sprintf("%.0f ms", c.eight.ITLp99ms))
			cols[6] = append(cols[6], fmt.Sprintf("%.1f", c.eight.DecodeTokS))
			failed += c.one.Failed + c.eight.Failed
		}
		fmt.Fprintf(w, "%s\t", s.name)
		for _, c := range cols[:7] {
			fmt.Fprintf(w, "%s\t", strings.Join(c, " / "))
		}
		fmt.Fprintf(w, "%d\t\n", failed)
	}
	// Ratios within each round: infernode against ollama.
	for r := range rounds {
		a, b := results[inf.name][r], results[oll.name][r]
		fmt.Fprintf(w, "ratio, round %d\t%.2fx\t%.2fx\t%.2fx\t%.2fx\t%.2fx\t%.2fx\t%.2fx\t\t\n", r+1,
			wallRate(a.one)/wallRate(b.one), wallRate(a.eight)/wallRate(b.eight),
			a.eight.TTFTp50ms/b.eight.TTFTp50ms, a.eight.TTFTp99ms/b.eight.TTFTp99ms,
			a.eight.ITLp50ms/b.eight.ITLp50ms, a.eight.ITLp99ms/b.eight.ITLp99ms, a.eight.DecodeTokS/b.eight.DecodeTokS)
	}
	if err := w.Flush(); err != nil {
		return err
	}

	// The first wave's floor. A wave is 8 prompts arriving at once (loadgen's rounds): its
	// last first token cannot come before the wave is prefilled, and with equal prompts the
	// k-th no sooner than k/8 of that, whatever the order, so the median (of 1..8) no sooner
	// than 9/16 of it. The prefill time is the faster server's, waves of one token each.
	// The target is infernode's TTFT within 1.1x of these floors, as the median of the
	// rounds' ratios (at least 4 rounds), inter-token p99 beside it.
	fmt.Println()
	w = tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "\ta wave prefilled alone\tfloor of TTFT p50, 8\tinfernode TTFT p50, 8\tfloor of TTFT p99, 8\tinfernode TTFT p99, 8\tinfernode p50 / floor\tinfernode p99 / floor\tinfernode ITL p99, 8\t")
	var p50s, p99s, itls []float64
	for r := range rounds {
		a, b := results[inf.name][r], results[oll.name][r]
		floor := min(a.wave.TTFTp99ms, b.wave.TTFTp99ms)
		p50s, p99s, itls = append(p50s, a.eight.TTFTp50ms/(floor*9/16)), append(p99s, a.eight.TTFTp99ms/floor), append(itls, a.eight.ITLp99ms)
		fmt.Fprintf(w, "round %d\t%.0f ms (infernode) / %.0f ms (ollama)\t%.0f ms = %.2fx ollama's\t%.2fx\t%.0f ms = %.2fx ollama's\t%.2fx\t%.2fx\t%.2fx\t%.0f ms\t\n", r+1,
			a.wave.TTFTp99ms, b.wave.TTFTp99ms, floor*9/16, floor*9/16/b.eight.TTFTp50ms, a.eight.TTFTp50ms/b.eight.TTFTp50ms,
			floor, floor/b.eight.TTFTp99ms, a.eight.TTFTp99ms/b.eight.TTFTp99ms, p50s[r], p99s[r], itls[r])
	}
	fmt.Fprintf(w, "median of %d rounds\t\t\t\t\t\t%.2fx\t%.2fx\t%.0f ms\t\n", rounds, median(p50s), median(p99s), median(itls))
	return w.Flush()
}

// median is the middle of v (the mean of the two middle values of an even count).
func median(v []float64) float64 {
	s := slices.Sorted(slices.Values(v))
	if len(s) == 0 {
		return 0
	}
	return (s[(len(s)-1)/2] + s[len(s)/2]) / 2
}

// wallRate is tokens over wall time: prefill and time to first token included.
func wallRate(l measure.Level) float64 {
	if l.WallSeconds == 0 {
		return 0
	}
	return float64(l.TotalTokens) / l.WallSeconds
}

// loadRun runs loadgen against s: rounds rounds of n concurrent streams of tokens tokens
// after a 32-word prompt.
func loadRun(loadgen string, s *server, temperature float64, n, rounds, tokens int) (measure.Level, error) {
	args := []string{"--url", s.url, "--concurrency", fmt.Sprint(n), "--rounds", fmt.Sprint(rounds),
		"--max-tokens", fmt.Sprint(tokens), "--prompt-words", "32", "--temperature", fmt.Sprint(temperature)}
	if s.model != "" {
		args = append(args, "--model", s.model)
	}
	levels, err := measure.Loadgen(loadgen, args...)
	if err != nil {
		return measure.Level{}, fmt.Errorf("loadgen against %s: %w", s.name, err)
	}
	if len(levels) != 1 {
		return measure.Level{}, fmt.Errorf("loadgen against %s: %d levels, want 1", s.name, len(levels))
	}
	return levels[0], nil
}

package main

import (
	"fmt"
	"os"
	"runtime"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/infernode/infernode/internal/measure"
)

// Goodput mode (--goodput): open-loop load (cmd/loadgen --rate) at a sweep of request
// rates against each server, alternating round by round, measured against SLOs that come
// from llama.cpp alone and so favour neither server: the first token of the workload's
// median prompt on an idle context, and one decode step (BenchmarkRawFirstToken). Each
// rate is measured at 1x, 2x and 4x those SLOs; a server's goodput at a scale is its
// goodput at the highest rate where at least 90% of the requests met the SLO (DistServe's
// definition), 0 when none did.

type goodputConfig struct {
	raw      string // session/llama test binary
	rates    string
	duration time.Duration
}

// goodputScales are the SLO multiples measured.
var goodputScales = []float64{1, 2, 4}

func runGoodput(g goodputConfig, loadgen, model string, rounds int, temperature float64, servers ...*server) error {
	open := func(s *server, rates string, duration time.Duration, ttft, tpot time.Duration) ([]measure.OpenLevel, error) {
		args := []string{"--url", s.url, "--rate", rates, "--duration", duration.String(), "--temperature", fmt.Sprint(temperature),
			"--slo-ttft", ttft.String(), "--slo-tpot", tpot.String(), "--slo-scales", "1,2,4"}
		if s.model != "" {
			args = append(args, "--model", s.model)
		}
		levels, err := measure.LoadgenOpen(loadgen, args...)
		if err != nil {
			return nil, fmt.Errorf("loadgen against %s: %w", s.name, err)
		}
		return levels, nil
	}
	// The median prompt, as the first server counts it: a short run (a request a second,
	// follow-ups carrying their history as in the sweep).
	cal, err := open(servers[0], "1", 30*time.Second, time.Second, time.Second)
	if err != nil {
		return err
	}
	if len(cal) != 1 || cal[0].PromptP50 == 0 {
		return fmt.Errorf("calibration against %s: no prompt length in %+v", servers[0].name, cal)
	}
	ttft, tpot, err := measure.RawSLO(model, cal[0].PromptP50, runtime.NumCPU(), g.raw) // the threads both servers use
	if err != nil {
		return err
	}
	fmt.Printf("SLO from llama.cpp alone: the first token of the median prompt (%d tokens) in %v, then %v a token; measured at 1x, 2x and 4x\n\n",
		cal[0].PromptP50, ttft.Round(100*time.Microsecond), tpot.Round(100*time.Microsecond))

	results := map[string][][]measure.OpenLevel{} // server -> round -> rate
	for r := range rounds {
		for _, s := range servers {
			fmt.Fprintf(os.Stderr, "round %d: %s\n", r+1, s.name)
			levels, err := open(s, g.rates, g.duration, ttft, tpot)
			if err != nil {
				return err
			}
			results[s.name] = append(results[s.name], levels)
		}
	}

	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "server\tround\trate\tachieved\tfailed\tTTFT p50\tTTFT p99\tTPOT p50\tTPOT p99\tattained 1x / 2x / 4x\tgoodput 1x / 2x / 4x\t")
	for _, s := range servers {
		for r, levels := range results[s.name] {
			for _, l := range levels {
				var att, gp []string
				for _, sc := range l.Scaled {
					att, gp = append(att, fmt.Sprintf("%.0f%%", 100*sc.Attainment)), append(gp, fmt.Sprintf("%.2f", sc.Goodput))
				}
				fmt.Fprintf(w, "%s\t%d\t%g\t%.2f\t%d\t%.0f ms\t%.0f ms\t%.1f ms\t%.1f ms\t%s\t%s\t\n", s.name, r+1, l.Rate, l.Achieved, l.Failed,
					l.TTFTp50ms, l.TTFTp99ms, l.TPOTp50ms, l.TPOTp99ms, strings.Join(att, " / "), strings.Join(gp, " / "))
			}
		}
	}
	if err := w.Flush(); err != nil {
		return err
	}
	for _, goal := range measure.AttainmentGoals {
		fmt.Printf("\ngoodput at %.0f%% attainment (requests a second meeting the SLO, at the highest rate where %.0f%% did)\n", 100*goal, 100*goal)
		w = tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintf(w, "round\tSLO\t%s\t%s\t%s / %s\t\n", servers[0].name, servers[1].name, servers[0].name, servers[1].name)
		for r := range rounds {
			for i, scale := range goodputScales {
				a, arate := measure.GoodputAt(results[servers[0].name][r], i, goal)
				b, brate := measure.GoodputAt(results[servers[1].name][r], i, goal)
				ratio := "-"
				if b > 0 {
					ratio = fmt.Sprintf("%.2fx", a/b)
				}
				fmt.Fprintf(w, "%d\t%gx\t%.2f (rate %g)\t%.2f (rate %g)\t%s\t\n", r+1, scale, a, arate, b, brate, ratio)
			}
		}
		if err := w.Flush(); err != nil {
			return err
		}
	}
	return nil
}

// Command benchoverhead measures what infernode costs over llama.cpp alone, decoding the
// same model on the same machine: llama.cpp with nothing around it (session/llama's
// BenchmarkRawDecode), the engine (session's BenchmarkDecode), and one node through HTTP
// (cmd/loadgen against bin/infernode), at 1 and 8 streams. The machine's speed drifts by
// more than the costs being measured, so the three run in turn, N times, and every ratio
// is taken within one turn. make bench-overhead builds the test binaries and runs this.
//
//	benchoverhead --raw .build/llama.test --engine .build/session.test --turns 5
package main

import (
	"bufio"
	"bytes"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/infernode/infernode/internal/measure"
	"github.com/infernode/infernode/internal/poll"
)

func main() {
	raw := flag.String("raw", ".build/llama.test", "session/llama test binary (go test -c)")
	engine := flag.String("engine", ".build/session.test", "session test binary (go test -c)")
	infernode := flag.String("infernode", "bin/infernode", "infernode binary")
	loadgen := flag.String("loadgen", "bin/loadgen", "loadgen binary")
	model := flag.String("model", "models/smollm2-135m-shape.gguf", "GGUF all three decode")
	turns := flag.Int("turns", 5, "turns of the three measurements")
	flag.Parse()
	if err := run(*raw, *engine, *infernode, *loadgen, *model, *turns); err != nil {
		fmt.Fprintln(os.Stderr, "benchoverhead:", err)
		os.Exit(1)
	}
}

// rates is one measurement's decode tokens/s at 1 and at 8 streams.
type rates struct{ one, eight float64 }

func run(rawBin, engineBin, infernodeBin, loadgen, model string, turns int) error {
	model, err := filepath.Abs(model)
	if err != nil {
		return err
	}
	const addr = "127.0.0.1:18591"
	node := exec.Command(infernodeBin, "--model", model, "--addr", addr, "--seed", "1", "--log-level", "warn")
	node.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := node.Start(); err != nil {
		return fmt.Errorf("start infernode: %w", err)
	}
	defer syscall.Kill(-node.Process.Pid, syscall.SIGKILL)
	url := "http://" + addr
	if !poll.Answers200(url+"/readyz", time.Minute) {
		return fmt.Errorf("infernode at %s not ready within a minute", url)
	}
	if _, err := viaHTTP(loadgen, url, "1", 1); err != nil { // warm-up
		return err
	}

	// Every measurement samples at temperature 0.8, 64 tokens a stream, and counts decode
	// only (the engine and loadgen: while every stream decodes; llama.cpp alone: its steps).
	env := append(os.Environ(), "INFERNODE_BENCH_MODEL="+model)
	var raw, eng, web []rates
	for t := range turns {
		fmt.Fprintf(os.Stderr, "turn %d of %d\n", t+1, turns)
		r, err := benchmark(rawBin, env, "RawDecode/seqs=(1|8)/temp=0.8$", `seqs=(\d+)/temp`)
		if err != nil {
			return err
		}
		e, err := benchmark(engineBin, env, "Decode/unified=true/seqs=(1|8)$", `seqs=(\d+)-`)
		if err != nil {
			return err
		}
		h, err := viaHTTP(loadgen, url, "1,8", 2)
		if err != nil {
			return err
		}
		raw, eng, web = append(raw, r), append(eng, e), append(web, h)
	}

	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "turn\tllama.cpp, 1\tengine, 1\tHTTP, 1\tllama.cpp, 8\tengine, 8\tHTTP, 8\tHTTP / llama.cpp, 1\tHTTP / engine, 8\tengine / llama.cpp, 1\tengine / llama.cpp, 8\t")
	var cols [4][]float64
	for t := range turns {
		r, e, h := raw[t], eng[t], web[t]
		ratios := [4]float64{h.one / r.one, h.eight / e.eight, e.one / r.one, e.eight / r.eight}
		for i, x := range ratios {
			cols[i] = append(cols[i], x)
		}
		fmt.Fprintf(w, "%d\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\t%.2fx\t%.2fx\t%.2fx\t%.2fx\t\n", t+1,
			r.one, e.one, h.one, r.eight, e.eight, h.eight, ratios[0], ratios[1], ratios[2], ratios[3])
	}
	fmt.Fprintf(w, "median\t\t\t\t\t\t\t%.2fx\t%.2fx\t%.2fx\t%.2fx\t\n", median(cols[0]), median(cols[1]), median(cols[2]), median(cols[3]))
	return w.Flush()
}

// benchmark runs a test binary's benchmarks matching pattern, 3 iterations each, and reads
// their tok/s by stream count: the first group of the regexp streams in each name.
func benchmark(bin string, env []string, pattern, streams string) (rates, error) {
	cmd := exec.Command(bin, "-test.run", "^$", "-test.bench", pattern, "-test.benchtime", "3x")
	cmd.Env = env
	out, err := measure.Output(cmd)
	if err != nil {
		return rates{}, fmt.Errorf("%w: %s", err, out)
	}
	re := regexp.MustCompile(streams)
	var r rates
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		i := slices.Index(f, "tok/s")
		m := re.FindStringSubmatch(sc.Text())
		if !strings.HasPrefix(sc.Text(), "Benchmark") || i < 1 || m == nil {
			continue
		}
		v, err := strconv.ParseFloat(f[i-1], 64)
		if err != nil {
			return rates{}, fmt.Errorf("%s: %q: %w", bin, sc.Text(), err)
		}
		switch m[1] {
		case "1":
			r.one = v
		case "8":
			r.eight = v
		}
	}
	if r.one == 0 || r.eight == 0 {
		return rates{}, fmt.Errorf("%s: no tok/s at 1 and 8 streams in:\n%s", bin, out)
	}
	return r, nil
}

// viaHTTP runs loadgen against the node: rounds rounds at each concurrency level.
func viaHTTP(loadgen, url, levels string, rounds int) (rates, error) {
	ls, err := measure.Loadgen(loadgen, "--url", url, "--concurrency", levels, "--rounds", fmt.Sprint(rounds),
		"--max-tokens", "64", "--temperature", "0.8")
	if err != nil {
		return rates{}, err
	}
	var r rates
	for _, l := range ls {
		if l.Failed > 0 {
			return rates{}, fmt.Errorf("loadgen: %d of %d requests failed at %d streams", l.Failed, l.Requests, l.Concurrency)
		}
		switch l.Concurrency {
		case 1:
			r.one = l.DecodeTokS
		case 8:
			r.eight = l.DecodeTokS
		}
	}
	return r, nil
}

func median(xs []float64) float64 {
	s := slices.Sorted(slices.Values(xs))
	if n := len(s); n%2 == 0 {
		return (s[n/2-1] + s[n/2]) / 2
	}
	return s[len(s)/2]
}

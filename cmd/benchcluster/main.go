// Command benchcluster measures an infernode cluster against what a user would build
// instead: the same number of ollama servers behind nginx, round robin and sticky
// (consistent hash on the session header). Every backend process is pinned to its own core
// (node i and ollama server i share core i, and only one side runs load at a time), the
// model, parallel sequences and context per sequence are the same, and the same seeded
// open-loop multi-turn workload (cmd/loadgen --rate) runs against each setup in turn, all
// three through nginx (nginx.conf.tmpl, as committed). make bench-cluster-compare runs it.
//
// It reports, per setup: the follow-up turns' first token (p50/p99), goodput at 90%
// attainment of SLOs from llama.cpp alone (as benchcompare's goodput mode, at 1x, 2x and
// 4x), and what a SIGKILL of one backend mid-run does: answers failed (and how many of
// those had their client connection through the killed process), answers resumed, and
// whether the killed backend's conversations come back warm.
//
//	benchcluster --ollama .build/ollama --raw .build/llama.test --model models/smollm2-135m-shape.gguf
package main

import (
	"bytes"
	"context"
	_ "embed"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"text/tabwriter"
	"text/template"
	"time"

	"github.com/infernode/infernode/internal/measure"
	"github.com/infernode/infernode/internal/poll"
	"github.com/infernode/infernode/testbed"
	"github.com/prometheus/procfs"
)

//go:embed nginx.conf.tmpl
var nginxConf string

// Ports: nginx listens on nginxPort+i for setup i; infernode node i on infernodePort+i
// (gossip gossipPort+i), the B cluster's on infernodeBPort+i (gossipBPort+i); ollama
// server i on ollamaPort+i.
const (
	nginxPort      = 18600
	infernodePort  = 18610
	ollamaPort     = 18620
	infernodeBPort = 18630
	gossipPort     = 18710
	gossipBPort    = 18730
)

// scales are the SLO multiples measured.
var scales = []float64{1, 2, 4}

type config struct {
	infernode, infernodeB, ollama, loadgen, nginx string
	raw, model                                    string
	nodes, parallel, cells, rounds, ollamaCtx     int
	rates                                         string
	duration, killDuration                        time.Duration
	killRate, temperature                         float64
	killSeed                                      uint64
	keep, kill                                    bool
	infernodeArgs, infernodeBArgs                 string
}

func main() {
	var c config
	flag.StringVar(&c.infernode, "infernode", "bin/infernode", "infernode binary")
	flag.StringVar(&c.ollama, "ollama", ".build/ollama", "ollama binary (make .build/ollama builds it)")
	flag.StringVar(&c.loadgen, "loadgen", "bin/loadgen", "loadgen binary")
	flag.StringVar(&c.nginx, "nginx", "nginx", "nginx binary")
	flag.StringVar(&c.raw, "raw", ".build/llama.test", "the session/llama test binary (go test -c) whose BenchmarkRawFirstToken sets the SLOs")
	flag.StringVar(&c.model, "model", "models/smollm2-135m-shape.gguf", "GGUF every backend serves")
	flag.IntVar(&c.nodes, "nodes", 2, "backends a side (each pinned to a core)")
	flag.IntVar(&c.parallel, "parallel", 8, "sequences each backend runs at once (infernode --sequences, OLLAMA_NUM_PARALLEL)")
	flag.IntVar(&c.cells, "ctx", 8192, "KV cells each backend holds over all its sequences (infernode --ctx; ollama's num_ctx is this over --parallel)")
	// ollama drops a conversation's earliest messages when its prompt exceeds num_ctx;
	// infernode's sequences share the whole pool, so it serves those histories whole.
	flag.IntVar(&c.ollamaCtx, "ollama-num-ctx", 0, "ollama's num_ctx, a sequence (0: --ctx over --parallel; ollama truncates longer histories, infernode does not)")
	flag.IntVar(&c.rounds, "rounds", 2, "rounds of the sweep, alternating the setups in each")
	flag.StringVar(&c.rates, "rates", "0.5,1,1.5,2", "request rates swept (a second, the whole cluster)")
	flag.DurationVar(&c.duration, "rate-duration", 45*time.Second, "how long each rate runs")
	flag.Float64Var(&c.killRate, "kill-rate", 1, "request rate of the kill runs")
	// The seed's draw decides whether conversations span the kill (some draws have none
	// across the half-way mark): 101's, at a request a second for a minute, has ten later
	// turns of conversations begun in the 10 s before it.
	flag.Uint64Var(&c.killSeed, "kill-seed", 101, "workload seed of the kill runs (one whose conversations span the kill; the report says when none did)")
	// Not greedy by default: the benchmark model's random weights loop under greedy
	// decoding, and ollama ends a stream whose token repeats 31 times without a finish
	// (llm.Completion's repeat guard), which would count as its failures and end its
	// conversations early. Sampled, the guard does not fire.
	flag.Float64Var(&c.temperature, "temperature", 1, "sampling temperature of every request (0: greedy, where the benchmark model loops and ollama cuts answers short)")
	flag.StringVar(&c.infernodeArgs, "infernode-args", "", "more flags for every infernode node (for an A/B: --replicas 0, ...)")
	flag.StringVar(&c.infernodeBArgs, "infernode-b-args", "", "an A/B in one run: a second infernode cluster (on the same cores) with these flags too, measured in turn with the others; no kill run")
	flag.StringVar(&c.infernodeB, "infernode-b", "", "an A/B of binaries in one run: the second infernode cluster runs this binary (with --infernode-b-args, if any)")
	flag.BoolVar(&c.kill, "kill", true, "run the kill runs after the sweep")
	flag.BoolVar(&c.keep, "keep", false, "keep the work directory (logs, nginx.conf, the kill runs' records); kept anyway on an error")
	flag.DurationVar(&c.killDuration, "kill-duration", 60*time.Second, "length of a kill run: the last backend is killed half-way")
	flag.Parse()
	if err := run(c); err != nil {
		fmt.Fprintln(os.Stderr, "benchcluster:", err)
		os.Exit(1)
	}
}

// setup is one side of the comparison: nginx in front of a set of backends.
type setup struct {
	Name     string   // nginx's upstream name
	Title    string   // as the tables print it
	Listen   string   // nginx's address for it
	Backends []string // host:port
	Sticky   bool     // consistent hash on X-Session-ID, else round robin
	model    string   // model id requests name ("": the server's first)
	backends *backends
}

func (s *setup) url() string { return "http://" + s.Listen }

// backends is one kind of server, N of them, with a way to kill and revive the last.
type backends struct {
	// kill SIGKILLs the last backend; served is the name its answers carry (an infernode
	// node's id, an ollama server's address), upstream the address nginx knows it by.
	kill   func() (served, upstream string)
	revive func(context.Context) error
	// groups are the backends' process groups (a backend's processes are its group's).
	groups func() []int
}

func run(c config) (err error) {
	ctx := context.Background()
	for _, p := range []*string{&c.infernode, &c.infernodeB, &c.ollama, &c.loadgen, &c.raw, &c.model} {
		if *p == "" {
			continue
		}
		if *p, err = filepath.Abs(*p); err != nil {
			return err
		}
	}
	work, err := os.MkdirTemp("", "benchcluster")
	if err != nil {
		return err
	}
	defer func() {
		if err != nil || c.keep {
			fmt.Fprintln(os.Stderr, "benchcluster: logs, nginx.conf and records kept in", work)
			return
		}
		os.RemoveAll(work)
	}()

	// infernode: a cluster of nodes, node i pinned to core i.
	startCluster := func(name, binary string, httpPort, gossip int, more string) (*testbed.Cluster, *setup, error) {
		cluster, err := testbed.Start(ctx, testbed.Config{Binary: binary, Model: c.model, Nodes: c.nodes, Pin: true,
			HTTPPort: httpPort, GossipPort: gossip, LogDir: filepath.Join(work, name),
			Args: append([]string{"--threads", "1", "--sequences", fmt.Sprint(c.parallel), "--ctx", fmt.Sprint(c.cells)}, strings.Fields(more)...)})
		if err != nil {
			return nil, nil, err
		}
		if _, err := cluster.WaitRings(ctx, cluster.IDs(), time.Minute); err != nil {
			cluster.Close()
			return nil, nil, err
		}
		s := &setup{Name: name, Title: "infernode, nginx round robin", backends: &backends{groups: func() (g []int) {
			for _, n := range cluster.Nodes {
				g = append(g, n.Pid()) // each node leads its group
			}
			return g
		}}}
		for _, n := range cluster.Nodes {
			s.Backends = append(s.Backends, n.HTTPAddr)
		}
		return cluster, s, nil
	}
	cluster, inf, err := startCluster("infernode", c.infernode, infernodePort, gossipPort, c.infernodeArgs)
	if err != nil {
		return err
	}
	defer cluster.Close()
	last := cluster.Nodes[len(cluster.Nodes)-1]
	inf.backends.kill = func() (string, string) { last.Kill(); return last.ID, last.HTTPAddr }
	inf.backends.revive = func(ctx context.Context) error {
		if err := last.Restart(ctx); err != nil {
			return err
		}
		_, err := cluster.WaitRings(ctx, cluster.IDs(), time.Minute)
		return err
	}

	// ollama: N servers, server i pinned to core i, one model made from the same GGUF with
	// one thread and the same context a sequence.
	oll, err := startOllama(ctx, c, work)
	if err != nil {
		return err
	}
	defer oll.close()
	rr := &setup{Name: "ollama_rr", Title: "ollama, nginx round robin", Backends: oll.addrs, model: "bench", backends: &oll.backends}
	sticky := &setup{Name: "ollama_sticky", Title: "ollama, nginx sticky", Backends: oll.addrs, Sticky: true, model: "bench", backends: &oll.backends}
	setups := []*setup{inf, rr, sticky}
	if c.infernodeBArgs != "" || c.infernodeB != "" {
		binary := c.infernode
		if c.infernodeB != "" {
			binary = c.infernodeB
		}
		clusterB, b, err := startCluster("infernode_b", binary, infernodeBPort, gossipBPort, c.infernodeArgs+" "+c.infernodeBArgs)
		if err != nil {
			return err
		}
		defer clusterB.Close()
		b.Title = strings.Join(strings.Fields("infernode "+c.infernodeB+" "+c.infernodeBArgs), " ") + ", nginx round robin"
		setups = append(setups, b)
	}
	for i, s := range setups {
		s.Listen = fmt.Sprintf("127.0.0.1:%d", nginxPort+i)
	}
	stopNginx, err := startNginx(c.nginx, work, setups)
	if err != nil {
		return err
	}
	defer stopNginx()

	// Warm every backend through nginx (round robin reaches each), then measure the
	// workload's median prompt and take the SLO from llama.cpp alone on one core.
	for _, s := range slices.DeleteFunc(slices.Clone(setups), func(s *setup) bool { return s == sticky }) {
		if _, err := measure.Loadgen(c.loadgen, c.args(s, "--concurrency", fmt.Sprint(2*c.nodes), "--rounds", "1", "--max-tokens", "8")...); err != nil {
			return fmt.Errorf("warm-up of %s: %w", s.Title, err)
		}
	}
	cal, err := measure.LoadgenOpen(c.loadgen, c.args(inf, "--rate", "1", "--duration", "30s")...)
	if err != nil {
		return err
	}
	if len(cal) != 1 || cal[0].PromptP50 == 0 {
		return fmt.Errorf("calibration: no prompt length in %+v", cal)
	}
	ttft, tpot, err := measure.RawSLO(c.model, cal[0].PromptP50, 1, "taskset", "-c", "0", c.raw)
	if err != nil {
		return err
	}
	slo := []string{"--slo-ttft", ttft.String(), "--slo-tpot", tpot.String(), "--slo-scales", "1,2,4"}
	fmt.Printf("%d backends a side, each pinned to a core; SLO from llama.cpp alone on one core: the first token of the median prompt (%d tokens) in %v, then %v a token\n\n",
		c.nodes, cal[0].PromptP50, ttft.Round(100*time.Microsecond), tpot.Round(100*time.Microsecond))

	sweep := map[*setup][][]measure.OpenLevel{}
	cpu := map[*setup][][]float64{}
	for r := range c.rounds {
		for _, s := range setups {
			fmt.Fprintf(os.Stderr, "round %d: %s\n", r+1, s.Title)
			before, err := groupCPU(s.backends.groups())
			if err != nil {
				return err
			}
			levels, err := measure.LoadgenOpen(c.loadgen, c.args(s, append([]string{"--rate", c.rates, "--duration", c.duration.String(),
				"--seed", fmt.Sprint(r + 1)}, slo...)...)...)
			if err != nil {
				return fmt.Errorf("%s: %w", s.Title, err)
			}
			after, err := groupCPU(s.backends.groups())
			if err != nil {
				return err
			}
			for i := range after {
				after[i] -= before[i]
			}
			sweep[s], cpu[s] = append(sweep[s], levels), append(cpu[s], after)
		}
	}
	kills := map[*setup]killResult{}
	for _, s := range setups[:3] {
		if !c.kill {
			break
		}
		fmt.Fprintf(os.Stderr, "kill: %s\n", s.Title)
		if kills[s], err = killRun(ctx, c, work, s, slo); err != nil {
			return fmt.Errorf("kill run of %s: %w", s.Title, err)
		}
	}
	return report(os.Stdout, c, setups, sweep, cpu, kills)
}

// groupCPU is the CPU time (user and system, in seconds) that the processes of each process
// group in pgids have used so far: an ollama server's group holds its runner too. A process
// that has exited no longer counts.
func groupCPU(pgids []int) ([]float64, error) {
	procs, err := procfs.AllProcs()
	if err != nil {
		return nil, err
	}
	out := make([]float64, len(pgids))
	for _, p := range procs {
		st, err := p.Stat()
		if err != nil {
			continue // exited since it was listed
		}
		if i := slices.Index(pgids, st.PGRP); i >= 0 {
			out[i] += st.CPUTime()
		}
	}
	return out, nil
}

// args are loadgen's flags for s, then more.
func (c *config) args(s *setup, more ...string) []string {
	a := []string{"--url", s.url(), "--temperature", fmt.Sprint(c.temperature), "--session-header", "X-Session-ID"}
	if s.model != "" {
		a = append(a, "--model", s.model)
	}
	return append(a, more...)
}

// ollamaServers are the running ollama servers.
type ollamaServers struct {
	backends
	addrs []string
	cmds  []*exec.Cmd
}

func (o *ollamaServers) close() {
	for _, cmd := range o.cmds {
		if cmd != nil && cmd.Process != nil {
			syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) // serve and its runner
			cmd.Wait()
		}
	}
}

func startOllama(ctx context.Context, c config, work string) (*ollamaServers, error) {
	o := &ollamaServers{}
	start := func(i int) error {
		cmd := exec.Command("taskset", "-c", fmt.Sprint(i%runtime.NumCPU()), c.ollama, "serve")
		cmd.Env = append(os.Environ(), "OLLAMA_HOST="+o.addrs[i], "OLLAMA_MODELS="+filepath.Join(work, "ollama"),
			fmt.Sprintf("OLLAMA_NUM_PARALLEL=%d", c.parallel), "OLLAMA_KEEP_ALIVE=1h", "OLLAMA_MAX_QUEUE=4096")
		log, err := os.Create(filepath.Join(work, fmt.Sprintf("ollama-%d.log", i)))
		if err != nil {
			return err
		}
		cmd.Stdout, cmd.Stderr = log, log
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true} // the runner it starts is in its group
		if err := cmd.Start(); err != nil {
			return fmt.Errorf("start ollama: %w", err)
		}
		o.cmds[i] = cmd
		if !poll.Answers200("http://"+o.addrs[i]+"/", time.Minute) {
			return fmt.Errorf("ollama on %s did not answer within a minute", o.addrs[i])
		}
		return nil
	}
	for i := range c.nodes {
		o.addrs, o.cmds = append(o.addrs, fmt.Sprintf("127.0.0.1:%d", ollamaPort+i)), append(o.cmds, nil)
		if err := start(i); err != nil {
			o.close()
			return nil, err
		}
	}
	numCtx := c.ollamaCtx
	if numCtx == 0 {
		numCtx = c.cells / c.parallel
	}
	modelfile := filepath.Join(work, "Modelfile")
	if err := os.WriteFile(modelfile, fmt.Appendf(nil, "FROM %s\nPARAMETER num_thread 1\nPARAMETER num_ctx %d\n", c.model, numCtx), 0o644); err != nil {
		o.close()
		return nil, err
	}
	create := exec.Command(c.ollama, "create", "bench", "-f", modelfile) // the servers share the model store
	create.Env = append(os.Environ(), "OLLAMA_HOST="+o.addrs[0])
	if out, err := create.CombinedOutput(); err != nil {
		o.close()
		return nil, fmt.Errorf("ollama create: %w: %s", err, out)
	}
	o.groups = func() (g []int) {
		for _, cmd := range o.cmds {
			g = append(g, cmd.Process.Pid) // taskset execs ollama, which leads its group
		}
		return g
	}
	i := c.nodes - 1
	o.kill = func() (string, string) {
		syscall.Kill(-o.cmds[i].Process.Pid, syscall.SIGKILL)
		o.cmds[i].Wait()
		return o.addrs[i], o.addrs[i]
	}
	o.revive = func(ctx context.Context) error {
		if err := start(i); err != nil {
			return err
		}
		// Load the model before the next run measures anything.
		_, err := measure.Loadgen(c.loadgen, "--url", "http://"+o.addrs[i], "--model", "bench", "--concurrency", "1", "--rounds", "1", "--max-tokens", "4")
		return err
	}
	return o, nil
}

// startNginx renders the configuration for setups and runs nginx on it until stop.
func startNginx(bin, work string, setups []*setup) (stop func(), err error) {
	dir := filepath.Join(work, "nginx")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	var conf bytes.Buffer
	if err := template.Must(template.New("nginx").Parse(nginxConf)).Execute(&conf, map[string]any{"Dir": dir, "Setups": setups}); err != nil {
		return nil, err
	}
	path := filepath.Join(dir, "nginx.conf")
	if err := os.WriteFile(path, conf.Bytes(), 0o644); err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, "-p", dir, "-c", path)
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true} // its worker is in its group
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start nginx (make bench-cluster-compare installs it): %w", err)
	}
	stop = func() { syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL); cmd.Wait() }
	for _, s := range setups {
		if !poll.Answers200(s.url()+"/v1/models", 30*time.Second) {
			stop()
			return nil, fmt.Errorf("nginx on %s: GET /v1/models did not answer 200", s.Listen)
		}
	}
	return stop, nil
}

// killResult is what a SIGKILL of one backend half-way through a run did.
type killResult struct {
	level measure.OpenLevel
	// failed counts the failed answers; throughKilled those whose client connection ran
	// through the killed process (its socket died with it, whatever any backend does).
	failed, throughKilled, resumed int
	// moved are the follow-ups, sent after the kill, of conversations whose previous turn
	// the killed backend served; others the other follow-ups after the kill.
	moved, others            []time.Duration
	movedPrompt, movedCached int
}

func killRun(ctx context.Context, c config, work string, s *setup, slo []string) (killResult, error) {
	records := filepath.Join(work, s.Name+"-kill.jsonl")
	type answer struct {
		levels []measure.OpenLevel
		err    error
	}
	done := make(chan answer, 1)
	go func() {
		l, err := measure.LoadgenOpen(c.loadgen, c.args(s, append([]string{"--rate", fmt.Sprint(c.killRate), "--duration", c.killDuration.String(),
			"--seed", fmt.Sprint(c.killSeed), "--records", records}, slo...)...)...)
		done <- answer{l, err}
	}()
	time.Sleep(c.killDuration / 2) // the experiment's schedule: the kill comes half-way through the load
	killedAt := time.Now()
	served, upstream := s.backends.kill()
	a := <-done
	if err := errors.Join(a.err, s.backends.revive(ctx)); err != nil {
		return killResult{}, err
	}
	if len(a.levels) != 1 {
		return killResult{}, fmt.Errorf("loadgen answered %d rates, want 1", len(a.levels))
	}
	reqs, err := measure.ReadRequests(records)
	if err != nil {
		return killResult{}, err
	}
	res := sortKill(reqs, killedAt, served, upstream)
	res.level = a.levels[0]
	return res, nil
}

// sortKill sorts a kill run's requests: failed answers (through the killed process's socket
// or not), resumed ones, and the follow-ups after the kill of the killed backend's
// conversations against the others'.
func sortKill(reqs []measure.Request, at time.Time, served, upstream string) killResult {
	var k killResult
	byConv := map[string][]measure.Request{}
	for _, r := range reqs {
		k.resumed += r.Resumed
		if r.Error != "" {
			k.failed++
			if r.Connected() == upstream {
				k.throughKilled++
			}
		}
		byConv[r.Conversation] = append(byConv[r.Conversation], r)
	}
	for _, turns := range byConv {
		slices.SortFunc(turns, func(a, b measure.Request) int { return a.Turn - b.Turn })
		for i := 1; i < len(turns); i++ {
			prev, r := turns[i-1], turns[i]
			if r.Error != "" || !r.Start.After(at) || prev.Start.After(at) {
				continue
			}
			ttft := time.Duration(r.TTFTms * float64(time.Millisecond))
			if prev.Served() == served {
				k.moved = append(k.moved, ttft)
				k.movedPrompt, k.movedCached = k.movedPrompt+r.PromptTokens, k.movedCached+r.CachedTokens
			} else {
				k.others = append(k.others, ttft)
			}
		}
	}
	return k
}

func report(w0 io.Writer, c config, setups []*setup, sweep map[*setup][][]measure.OpenLevel, work map[*setup][][]float64, kills map[*setup]killResult) error {
	ms := func(v float64) string { return fmt.Sprintf("%.0f ms", v) }
	w := tabwriter.NewWriter(w0, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "setup\tround\trate\tachieved\tfailed\tTTFT p50\tTTFT p99\tfollow-up TTFT p50\tfollow-up TTFT p99\tfollow-ups cached\tTPOT p50\tITL p50\tlast token to end p50 / p99\tattained 1x / 2x / 4x\t")
	for _, s := range setups {
		for r, levels := range sweep[s] {
			for _, l := range levels {
				var att []string
				for _, sc := range l.Scaled {
					att = append(att, fmt.Sprintf("%.0f%%", 100*sc.Attainment))
				}
				cached := "not reported"
				if l.FollowCached >= 0 {
					cached = fmt.Sprintf("%.0f%%", 100*l.FollowCached)
				}
				fmt.Fprintf(w, "%s\t%d\t%g\t%.2f\t%d\t%s\t%s\t%s\t%s\t%s\t%.1f ms\t%.1f ms\t%s / %s\t%s\t\n", s.Title, r+1, l.Rate, l.Achieved, l.Failed,
					ms(l.TTFTp50ms), ms(l.TTFTp99ms), ms(l.FollowTTFTp50ms), ms(l.FollowTTFTp99ms), cached, l.TPOTp50ms, l.ITLp50ms,
					ms(l.EndWaitp50ms), ms(l.EndWaitp99ms), strings.Join(att, " / "))
			}
		}
	}
	if err := w.Flush(); err != nil {
		return err
	}

	inf, rr, sticky := setups[0], setups[1], setups[2]
	ratio := func(a, b float64) string {
		if b == 0 {
			return "-"
		}
		return fmt.Sprintf("%.2fx", a/b)
	}
	fmt.Fprintf(w0, "\nfollow-up turns' first token, infernode over each nginx setup at the same rate (goals: p50 at most 0.2x round robin's; p99 at most 1x sticky's)\n")
	w = tabwriter.NewWriter(w0, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "round\trate\tp50 / round robin\tp99 / round robin\tp50 / sticky\tp99 / sticky\t")
	for r := range c.rounds {
		for i, l := range sweep[inf][r] {
			a, b := sweep[rr][r][i], sweep[sticky][r][i]
			fmt.Fprintf(w, "%d\t%g\t%s\t%s\t%s\t%s\t\n", r+1, l.Rate, ratio(l.FollowTTFTp50ms, a.FollowTTFTp50ms), ratio(l.FollowTTFTp99ms, a.FollowTTFTp99ms),
				ratio(l.FollowTTFTp50ms, b.FollowTTFTp50ms), ratio(l.FollowTTFTp99ms, b.FollowTTFTp99ms))
		}
	}
	if err := w.Flush(); err != nil {
		return err
	}

	for _, goal := range measure.AttainmentGoals {
		fmt.Fprintf(w0, "\ngoodput at %.0f%% attainment, requests a second (the highest rate swept where %.0f%% met the SLO); goals: 1.5x round robin's, 1.2x sticky's\n",
			100*goal, 100*goal)
		w = tabwriter.NewWriter(w0, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintf(w, "round\tSLO\t%s\t%s\t%s\tover round robin\tover sticky\t", inf.Title, rr.Title, sticky.Title)
		for _, b := range setups[3:] {
			fmt.Fprintf(w, "%s\tthe first over it\t", b.Title)
		}
		fmt.Fprintln(w)
		for r := range c.rounds {
			for i, scale := range scales {
				g := func(s *setup) float64 { v, _ := measure.GoodputAt(sweep[s][r], i, goal); return v }
				fmt.Fprintf(w, "%d\t%gx\t%.2f\t%.2f\t%.2f\t%s\t%s\t", r+1, scale, g(inf), g(rr), g(sticky), ratio(g(inf), g(rr)), ratio(g(inf), g(sticky)))
				for _, b := range setups[3:] {
					fmt.Fprintf(w, "%.2f\t%s\t", g(b), ratio(g(inf), g(b)))
				}
				fmt.Fprintln(w)
			}
		}
		if err := w.Flush(); err != nil {
			return err
		}
	}

	fmt.Fprintf(w0, "\nCPU time the backends spent on each round's sweep: what a request sent costs, and what 1,000 tokens answered cost (prompt and completion tokens of the requests that did not fail: a failed turn ends its conversation, so a setup that fails is sent fewer of the later, longer turns, and a request sent flatters it), and the busiest backend's share\n")
	w = tabwriter.NewWriter(w0, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "setup\tround\trequests\tfailed\tCPU\ta request\tover infernode's\ttokens answered\t1k tokens\tover infernode's\tbusiest backend's share\t")
	cost := func(s *setup, r int) (perRequest, perKTokens float64, sent, failed, answered int) {
		for _, l := range sweep[s][r] {
			sent, failed, answered = sent+l.Requests, failed+l.Failed, answered+l.Answered
		}
		cpu := sum(work[s][r])
		return cpu / float64(sent), 1000 * cpu / float64(answered), sent, failed, answered
	}
	for _, s := range setups {
		for r, cpu := range work[s] {
			per, perK, sent, failed, answered := cost(s, r)
			base, baseK, _, _, _ := cost(inf, r)
			fmt.Fprintf(w, "%s\t%d\t%d\t%d\t%.1f s\t%.0f ms\t%s\t%d\t%.0f ms\t%s\t%.0f%%\t\n", s.Title, r+1, sent, failed, sum(cpu), 1000*per,
				ratio(per, base), answered, 1000*perK, ratio(perK, baseK), 100*slices.Max(cpu)/sum(cpu))
		}
	}
	if err := w.Flush(); err != nil {
		return err
	}

	if !c.kill {
		return nil
	}
	fmt.Fprintf(w0, "\nthe last backend SIGKILLed half-way through %v at %g requests a second, seed %d (goal: no failed answers, against nginx's)\n", c.killDuration, c.killRate, c.killSeed)
	w = tabwriter.NewWriter(w0, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "setup\trequests\tfailed\tof them through the killed process\tresumed\tits conversations' follow-ups after\ttheir TTFT p50\tcached\tother follow-ups' TTFT p50\t")
	for _, s := range setups[:3] {
		k := kills[s]
		cached := "-"
		if k.movedPrompt > 0 {
			cached = fmt.Sprintf("%.0f%%", 100*float64(k.movedCached)/float64(k.movedPrompt))
		}
		p50 := func(d []time.Duration) string { return ms(float64(measure.Percentile(d, 50).Microseconds()) / 1000) }
		fmt.Fprintf(w, "%s\t%d\t%d\t%d\t%d\t%d\t%s\t%s\t%s\t\n", s.Title, k.level.Requests, k.failed, k.throughKilled, k.resumed,
			len(k.moved), p50(k.moved), cached, p50(k.others))
	}
	if err := w.Flush(); err != nil {
		return err
	}
	for _, s := range setups[:3] {
		if k := kills[s]; len(k.moved)+len(k.others) == 0 {
			fmt.Fprintf(w0, "%s: no conversation spanned the kill (no follow-up after it to a turn before it), so this kill tested nothing there: try another --kill-seed\n", s.Title)
		}
	}
	return nil
}

func sum(v []float64) (t float64) {
	for _, x := range v {
		t += x
	}
	return t
}

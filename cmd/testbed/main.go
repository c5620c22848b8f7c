// Command testbed launches and drives real infernode clusters.
//
//	testbed run --nodes 3          start a local cluster (what `make run` does) until Ctrl-C
//	testbed chaos --suite long     run chaos scenarios, print summaries, write JSON reports
//	testbed autoscale              ramp a load up and down on a cluster that scales itself
//	testbed cleanup                remove network namespaces left by a killed run
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/infernode/infernode/netem"
	"github.com/infernode/infernode/testbed"
)

const usage = `Usage:
  testbed run [flags]      start a local cluster on loopback and keep it up until Ctrl-C
  testbed chaos [flags]    run a chaos suite against real clusters and report
  testbed autoscale [flags] ramp a load from 0.5x to 4x one node's capacity and back on a
                           cluster whose scale hook starts and stops CPU-limited nodes
  testbed cleanup          remove network namespaces and links left by a killed run
`

func main() {
	if len(os.Args) < 2 {
		fmt.Fprint(os.Stderr, usage)
		os.Exit(2)
	}
	switch os.Args[1] {
	case "run":
		os.Exit(run(os.Args[2:]))
	case "chaos":
		os.Exit(chaos(os.Args[2:]))
	case "autoscale":
		os.Exit(autoscale(os.Args[2:]))
	case "cleanup":
		for _, prefix := range []string{"infch", "inft", "infc", "inf"} {
			netem.Cleanup(prefix)
		}
		os.Exit(0)
	default:
		fmt.Fprint(os.Stderr, usage)
		os.Exit(2)
	}
}

func chaos(args []string) int {
	fs := flag.NewFlagSet("testbed chaos", flag.ContinueOnError)
	binary := fs.String("binary", "bin/infernode", "infernode binary")
	model := fs.String("model", "../shared/models/stories260K.gguf", "GGUF model for every node (a real one: answers are compared with a reference)")
	suite := fs.String("suite", "long", "scenario suite: short or long")
	seed := fs.Uint64("seed", 0, "workload seed (0: from the clock; printed)")
	out := fs.String("out", ".build/chaos", "directory for JSON reports and node logs")
	only := fs.String("only", "", "run only the scenario of this name")
	nodeArgs := fs.String("node-args", "", "more flags for every node (a scenario's own flags win over them), e.g. \"--place-margin 2\"")
	engine := fs.String("engine", "", "flags of the engine's layout for every node and the reference node, e.g. \"--kv-unified=false --flash-attn=false\"")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if *seed == 0 {
		*seed = uint64(time.Now().UnixNano())
	}
	scenarios := testbed.LongSuite(*seed)
	if *suite == "short" {
		scenarios = testbed.ShortSuite(*seed)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	nsErr := netem.Available()
	failed := false
	for _, s := range scenarios {
		if *only != "" && s.Name != *only {
			continue
		}
		if s.Netns && nsErr != nil {
			fmt.Printf("scenario %s: SKIPPED: %v\n", s.Name, nsErr)
			continue
		}
		dir := filepath.Join(*out, s.Name)
		os.RemoveAll(dir) // node logs append: start each run's afresh
		os.MkdirAll(dir, 0o755)
		threads := max(1, runtime.NumCPU()/s.Nodes)
		rep, err := testbed.RunScenario(ctx, testbed.Config{Binary: *binary, Model: *model, LogDir: dir, Engine: strings.Fields(*engine),
			Args: append([]string{"--threads", strconv.Itoa(threads), "--log-level", "info"}, strings.Fields(*nodeArgs)...)}, s)
		if err != nil {
			fmt.Fprintf(os.Stderr, "scenario %s: %v\n", s.Name, err)
			failed = true
			continue
		}
		rep.Summary(os.Stdout)
		if err := rep.Save(dir); err != nil {
			fmt.Fprintf(os.Stderr, "scenario %s: %v\n", s.Name, err)
			failed = true
		}
		fmt.Printf("  report: %s, timeline: %s\n\n", filepath.Join(dir, "report.json"), filepath.Join(dir, "timeline.png"))
		failed = failed || !rep.Passed()
	}
	if failed {
		return 1
	}
	return 0
}

func autoscale(args []string) int {
	fs := flag.NewFlagSet("testbed autoscale", flag.ContinueOnError)
	binary := fs.String("binary", "bin/infernode", "infernode binary")
	model := fs.String("model", "../shared/models/stories260K.gguf", "GGUF model for every node")
	seed := fs.Uint64("seed", 0, "arrival seed (0: from the clock; printed)")
	out := fs.String("out", ".build/autoscale", "directory for the report, the timeline and node logs")
	a := testbed.DefaultAutoscale(0)
	fs.DurationVar(&a.Stage, "stage", a.Stage, "length of each load stage")
	fs.IntVar(&a.CPU, "cpu", a.CPU, "percent of one CPU each node gets")
	fs.DurationVar(&a.CPUPeriod, "cpu-period", a.CPUPeriod, "the period of that share (the kernel default is 100ms: a node that spends its share early is stopped for the rest of it)")
	fs.IntVar(&a.Max, "max", a.Max, "most nodes the controller may ask for")
	fs.BoolVar(&a.CalibrateOnly, "calibrate", false, "only calibrate: a node's capacity, interactive first tokens alone, alone again and beside batch work (5 minutes)")
	nodeArgs := fs.String("node-args", "", "more flags for every node, separated by spaces (an A/B of a flag in turn with the default)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if *seed == 0 {
		*seed = uint64(time.Now().UnixNano())
	}
	a.Seed = *seed
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	os.RemoveAll(*out)
	os.MkdirAll(*out, 0o755)
	rep, err := testbed.RunAutoscale(ctx, testbed.Config{Binary: *binary, Model: *model, LogDir: *out,
		Args: append([]string{"--log-level", "info"}, strings.Fields(*nodeArgs)...)}, a)
	if err != nil {
		fmt.Fprintf(os.Stderr, "autoscale: %v\n", err)
		return 1
	}
	rep.Summary(os.Stdout)
	if err := rep.Save(*out); err != nil {
		fmt.Fprintf(os.Stderr, "autoscale: %v\n", err)
		return 1
	}
	fmt.Printf("  report: %s, timeline: %s\n", filepath.Join(*out, "report.json"), filepath.Join(*out, "timeline.png"))
	if !rep.Passed() {
		return 1
	}
	return 0
}

func run(args []string) int {
	fs := flag.NewFlagSet("testbed run", flag.ContinueOnError)
	binary := fs.String("binary", "bin/infernode", "infernode binary")
	model := fs.String("model", "models/infernode-tiny.gguf", "GGUF model for every node")
	models := fs.String("models", "", "comma-separated GGUF models: node i serves the i-th (round robin); overrides --model")
	nodes := fs.Int("nodes", 3, "number of nodes")
	httpPort := fs.Int("http-port", 8081, "HTTP port of the first node; node i uses port+i")
	gossipPort := fs.Int("gossip-port", 7947, "gossip port of the first node; node i uses port+i")
	logDir := fs.String("log-dir", "", "where node logs go (default: a temporary directory)")
	nodeArgs := fs.String("node-args", "", "more flags for every node, separated by spaces")
	apiKey := fs.String("api-key", "", "the operator's API key every node requires (INFERNODE_API_KEY; tenants' keys go in a --key-file)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	// Nodes on one machine share its cores: llama.cpp threads that outnumber the cores
	// spin at their barriers while others hold the CPU, and every step stalls.
	threads := max(1, runtime.NumCPU() / *nodes)
	var paths []string
	if *models != "" {
		paths = strings.Split(*models, ",")
	}
	c, err := testbed.Start(ctx, testbed.Config{Binary: *binary, Model: *model, Models: paths, Nodes: *nodes,
		HTTPPort: *httpPort, GossipPort: *gossipPort, LogDir: *logDir, APIKey: *apiKey,
		Args: append([]string{"--log-level", "info", "--threads", strconv.Itoa(threads)}, strings.Fields(*nodeArgs)...)})
	if err != nil {
		fmt.Fprintf(os.Stderr, "testbed: %v\n", err)
		return 1
	}
	defer c.Close()
	// Each model's nodes make one ring.
	var took time.Duration
	for _, group := range c.ByModel() {
		var others []*testbed.Node
		for _, n := range c.Nodes {
			if !slices.Contains(group, n) {
				others = append(others, n)
			}
		}
		d, err := c.WaitRings(ctx, c.IDs(group...), 60*time.Second, others...)
		if err != nil {
			fmt.Fprintf(os.Stderr, "testbed: %v\n", err)
			return 1
		}
		took = max(took, d)
	}
	first := c.Nodes[0]
	fmt.Printf("\n%d nodes up; every ring holds all the nodes of its model (converged in %v).\n\n", len(c.Nodes), took.Round(time.Millisecond))
	statusArgs := []string{"status", "--addr", first.URL()}
	auth := ""
	if *apiKey != "" {
		statusArgs = append(statusArgs, "--api-key", *apiKey)
		auth = " -H 'Authorization: Bearer " + *apiKey + "'"
	}
	status := exec.Command(*binary, statusArgs...)
	status.Stdout, status.Stderr = os.Stdout, os.Stderr
	status.Run()
	fmt.Printf(`
Send a request to any node; it runs on the conversation's owner (see X-Infernode-Node):

  curl -si %s/v1/chat/completions -H 'Content-Type: application/json'%s \
    -d '{"messages":[{"role":"user","content":"tell me about the river"}],"max_tokens":24}'

The models the cluster serves: curl -s%s %s/v1/models (name one with "model" in a request)
Cluster table: %s
Node logs: %s
Ctrl-C stops every node.
`, c.Nodes[len(c.Nodes)-1].URL(), auth, auth, first.URL(), strings.Join(append([]string{*binary}, statusArgs...), " "), logDirOf(*logDir))
	<-ctx.Done()
	fmt.Println("\nstopping...")
	for _, n := range c.Nodes {
		if err := n.Stop(40 * time.Second); err != nil {
			fmt.Fprintf(os.Stderr, "testbed: %s: %v\n", n.ID, err)
		}
	}
	return 0
}

func logDirOf(dir string) string {
	if dir == "" {
		return "(temporary directory, see testbed's --log-dir)"
	}
	return dir
}

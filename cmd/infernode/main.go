// Command infernode runs one node of an infernode cluster: it loads a GGUF model and serves
// an OpenAI-compatible API over HTTP.
//
// Every flag can also be set by an environment variable: INFERNODE_ and the flag's name in
// capitals with dashes as underscores (--api-key is INFERNODE_API_KEY). A flag on the
// command line wins over the environment.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/infernode/infernode/gossip"
	"github.com/infernode/infernode/node"
	"github.com/infernode/infernode/session"
)

const usage = `infernode runs one node of an infernode cluster: a full replica of a GGUF model
behind an OpenAI-compatible HTTP API.

Usage:
  infernode --model PATH [flags]          run a node
  infernode status [--addr URL]           print the cluster as one node sees it

Example (the default test model, on port 8080):
  make model && bin/infernode --model models/infernode-tiny.gguf --addr 127.0.0.1:8080
  curl -s localhost:8080/v1/chat/completions -H 'Content-Type: application/json' \
    -d '{"messages":[{"role":"user","content":"hello"}],"max_tokens":16}'

A cluster: give each node --gossip-addr and all but the first --join FIRST_GOSSIP_ADDR:
  bin/infernode --model M --addr 127.0.0.1:8081 --gossip-addr 127.0.0.1:7947
  bin/infernode --model M --addr 127.0.0.1:8082 --gossip-addr 127.0.0.1:7948 --join 127.0.0.1:7947

Every flag may also come from the environment: INFERNODE_<NAME>, for example
INFERNODE_MODEL or INFERNODE_API_KEY. Command-line flags win.

Flags:
`

func main() {
	if len(os.Args) > 1 && os.Args[1] == "status" {
		os.Exit(status(os.Args[2:], os.Stdout, os.Stderr))
	}
	os.Exit(run(os.Args[1:], os.Stderr))
}

// options are the parsed flags.
type options struct {
	node        node.Config
	engine      session.Config
	cluster     node.ClusterConfig
	gossip      gossip.Config
	joinCluster bool // --gossip-addr given: run as a cluster member
	logJSON     bool
	logLvl      slog.Level
}

func run(args []string, stderr io.Writer) int {
	opts, err := parse(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintf(stderr, "infernode: %v\n", err)
		return 2
	}
	var h slog.Handler = slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: opts.logLvl})
	if opts.logJSON {
		h = slog.NewJSONHandler(stderr, &slog.HandlerOptions{Level: opts.logLvl})
	}
	log := slog.New(h)
	slog.SetDefault(log)
	if err := serve(opts, log); err != nil {
		log.Error("infernode failed", "err", err)
		return 1
	}
	return 0
}

func parse(args []string, stderr io.Writer) (options, error) {
	nc, ec, cc, gc := node.DefaultConfig(), session.DefaultConfig(), node.DefaultClusterConfig(), gossip.DefaultConfig()
	var gossipAddr, gossipAdvertise, join, gossipKey string
	fs := flag.NewFlagSet("infernode", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(stderr, usage)
		fs.PrintDefaults()
	}
	var logFormat, logLevel, maxBody string
	fs.StringVar(&ec.ModelPath, "model", "", "GGUF model file to serve (required)")
	fs.StringVar(&nc.ModelName, "model-name", "", "model id clients use (default: the file name without .gguf)")
	fs.StringVar(&nc.ID, "id", "", "node id shown in X-Infernode-Node and logs (default: host-port)")
	fs.StringVar(&nc.Addr, "addr", nc.Addr, "HTTP listen address (port 0 picks a free port; the log says which)")
	fs.StringVar(&nc.APIKey, "api-key", "", "require 'Authorization: Bearer KEY' on /v1/*")
	fs.BoolVar(&nc.ProtectOps, "protect-metrics", nc.ProtectOps, "require the API key on /metrics too")
	fs.IntVar(&ec.Cells, "ctx", ec.Cells, "KV cache size in tokens, over all sequences")
	fs.IntVar(&ec.Sequences, "sequences", ec.Sequences, "conversations held at once (running or cached)")
	fs.IntVar(&ec.BatchSize, "batch", ec.BatchSize, "tokens per decode step")
	fs.IntVar(&ec.Threads, "threads", ec.Threads, "CPU threads for inference")
	fs.BoolVar(&ec.UnifiedKV, "kv-unified", ec.UnifiedKV, "one KV pool shared by all sequences (false: fixed partitions)")
	fs.StringVar(&ec.KVType, "kv-type", ec.KVType, "KV cache type: f16, q8_0 or q4_0")
	fs.IntVar(&ec.MaxQueue, "max-queue", ec.MaxQueue, "requests that may wait for a sequence")
	fs.DurationVar(&ec.QueueTimeout, "queue-timeout", ec.QueueTimeout, "longest wait for a sequence before 503")
	fs.IntVar(&ec.MaxPromptTokens, "max-prompt-tokens", ec.MaxPromptTokens, "longest prompt accepted (0: the context)")
	fs.IntVar(&ec.DefaultMaxTokens, "default-max-tokens", ec.DefaultMaxTokens, "token limit of requests that set none")
	fs.IntVar(&nc.MaxTokens, "max-tokens", nc.MaxTokens, "largest max_tokens a request may ask for")
	fs.StringVar(&maxBody, "max-body", "4MiB", "largest request body (bytes, or with KiB/MiB)")
	fs.IntVar(&nc.MaxStreams, "max-streams", nc.MaxStreams, "generation requests in flight before 503")
	fs.DurationVar(&nc.RequestTimeout, "request-timeout", nc.RequestTimeout, "deadline of one generation request")
	fs.DurationVar(&nc.WriteTimeout, "write-timeout", nc.WriteTimeout, "cut a client that blocks a write this long")
	fs.DurationVar(&nc.DrainTimeout, "drain-timeout", nc.DrainTimeout, "on SIGTERM, how long running requests may finish")
	fs.Uint64Var(&ec.Seed, "seed", 0, "seed of the engine's random source (0: from the clock; logged)")
	fs.StringVar(&gossipAddr, "gossip-addr", "", "gossip bind host:port; empty runs standalone (no cluster)")
	fs.StringVar(&gossipAdvertise, "gossip-advertise", "", "gossip host:port peers dial (default: the bound address)")
	fs.StringVar(&join, "join", "", "comma-separated gossip addresses of seed peers")
	fs.StringVar(&gossipKey, "gossip-key", "", "encrypt gossip with this 16, 24 or 32 byte key (same on every node)")
	fs.StringVar(&cc.Secret, "cluster-secret", "", "authenticate forwarded requests between nodes (same on every node)")
	fs.StringVar(&cc.HTTPAddr, "advertise-http", "", "HTTP host:port peers use to reach this node (default: the bound address)")
	fs.DurationVar(&cc.ProbeInterval, "probe-interval", cc.ProbeInterval, "how often each peer's /readyz is checked")
	fs.StringVar(&logFormat, "log-format", "text", "log format: text or json")
	fs.StringVar(&logLevel, "log-level", "info", "log level: debug, info, warn or error")
	if err := fs.Parse(args); err != nil {
		return options{}, err
	}
	if fs.NArg() > 0 {
		return options{}, fmt.Errorf("unexpected argument %q (see --help)", fs.Arg(0))
	}
	if err := envFallback(fs); err != nil {
		return options{}, err
	}
	opts := options{node: nc, engine: ec, cluster: cc, gossip: gc, logJSON: logFormat == "json"}
	var errs []error
	if gossipAddr != "" {
		opts.joinCluster = true
		host, port, err := splitHostPort(gossipAddr)
		if err != nil {
			errs = append(errs, fmt.Errorf("--gossip-addr: %w", err))
		}
		opts.gossip.BindAddr, opts.gossip.BindPort = host, port
		if gossipAdvertise != "" {
			host, port, err := splitHostPort(gossipAdvertise)
			if err != nil {
				errs = append(errs, fmt.Errorf("--gossip-advertise: %w", err))
			}
			opts.gossip.AdvertiseAddr, opts.gossip.AdvertisePort = host, port
		}
		for _, seed := range strings.Split(join, ",") {
			if seed = strings.TrimSpace(seed); seed != "" {
				opts.gossip.Join = append(opts.gossip.Join, seed)
			}
		}
		opts.gossip.Key = []byte(gossipKey)
	} else if join != "" {
		errs = append(errs, errors.New("--join needs --gossip-addr"))
	}
	if logFormat != "text" && logFormat != "json" {
		errs = append(errs, fmt.Errorf("--log-format must be text or json, got %q", logFormat))
	}
	if err := opts.logLvl.UnmarshalText([]byte(logLevel)); err != nil {
		errs = append(errs, fmt.Errorf("--log-level: %w", err))
	}
	n, err := parseBytes(maxBody)
	if err != nil {
		errs = append(errs, fmt.Errorf("--max-body: %w", err))
	}
	opts.node.MaxBodyBytes = n
	if opts.engine.ModelPath == "" {
		errs = append(errs, errors.New("--model is required (make model writes the default test model)"))
	}
	if opts.node.ModelName == "" {
		opts.node.ModelName = strings.TrimSuffix(filepath.Base(opts.engine.ModelPath), ".gguf")
	}
	return opts, errors.Join(errs...)
}

// envFallback sets every flag not given on the command line from INFERNODE_<NAME>.
func envFallback(fs *flag.FlagSet) error {
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	var errs []error
	fs.VisitAll(func(f *flag.Flag) {
		env := "INFERNODE_" + strings.ToUpper(strings.ReplaceAll(f.Name, "-", "_"))
		if v, ok := os.LookupEnv(env); ok && !given[f.Name] {
			if err := fs.Set(f.Name, v); err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", env, err))
			}
		}
	})
	return errors.Join(errs...)
}

func splitHostPort(addr string) (string, int, error) {
	host, p, err := net.SplitHostPort(addr)
	if err != nil {
		return "", 0, err
	}
	port, err := strconv.Atoi(p)
	if err != nil || port < 0 || port > 65535 {
		return "", 0, fmt.Errorf("bad port in %q", addr)
	}
	return host, port, nil
}

func parseBytes(s string) (int, error) {
	mult := 1
	for suffix, m := range map[string]int{"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30} {
		if strings.HasSuffix(s, suffix) {
			s, mult = strings.TrimSuffix(s, suffix), m
		}
	}
	n, err := strconv.Atoi(s)
	if err != nil || n <= 0 {
		return 0, fmt.Errorf("want a positive size such as 4MiB, got %q", s)
	}
	return n * mult, nil
}

// serve runs the node until SIGINT or SIGTERM, then drains and exits.
func newCluster(opts options, ln net.Listener, local *node.LocalEngine, log *slog.Logger) (*node.Cluster, *gossip.Gossip, error) {
	fp, err := session.Fingerprint(opts.engine.ModelPath, opts.engine.KVType)
	if err != nil {
		return nil, nil, err
	}
	cc, gc := opts.cluster, opts.gossip
	if cc.HTTPAddr == "" {
		cc.HTTPAddr = ln.Addr().String()
		if tcp := ln.Addr().(*net.TCPAddr); tcp.IP.IsUnspecified() {
			return nil, nil, errors.New("--advertise-http is required when listening on all interfaces")
		}
	}
	cc.Self, cc.Fingerprint, cc.Logger = opts.node.ID, fp, log
	cc.APIKey, cc.DefaultMaxTokens, cc.QueueCap = opts.node.APIKey, opts.engine.DefaultMaxTokens, opts.engine.MaxQueue
	gc.ID, gc.Logger = opts.node.ID, log
	g, err := gossip.New(gc, gossip.Meta{ID: cc.Self, HTTPAddr: cc.HTTPAddr, Fingerprint: fp})
	if err != nil {
		return nil, nil, err
	}
	cluster, err := node.NewCluster(cc, g, local)
	if err != nil {
		return nil, nil, err
	}
	log.Info("clustered", "fingerprint", fp, "gossip", fmt.Sprintf("%s:%d", gc.BindAddr, gc.BindPort), "join", gc.Join)
	return cluster, g, nil
}

func serve(opts options, log *slog.Logger) error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()

	ln, err := net.Listen("tcp", opts.node.Addr)
	if err != nil {
		return fmt.Errorf("listen %s: %w", opts.node.Addr, err)
	}
	if opts.node.ID == "" {
		host, _ := os.Hostname()
		opts.node.ID = fmt.Sprintf("%s-%d", host, ln.Addr().(*net.TCPAddr).Port)
	}
	opts.node.Listener, opts.node.Logger, opts.engine.Logger = ln, log, log

	local := &node.LocalEngine{}
	var cluster *node.Cluster
	var g *gossip.Gossip
	if opts.joinCluster {
		if cluster, g, err = newCluster(opts, ln, local, log); err != nil {
			ln.Close()
			return err
		}
	}
	srv, err := node.New(opts.node, local, cluster)
	if err != nil {
		ln.Close()
		return err
	}
	// On SIGTERM: leave gossip first (peers stop routing here at once), then drain.
	gossipCtx, stopGossip := context.WithCancel(context.Background())
	defer stopGossip()
	gossipDone := make(chan error, 2)
	if cluster != nil {
		go func() { gossipDone <- g.Run(gossipCtx) }()
		go func() { gossipDone <- cluster.Run(gossipCtx) }()
		go func() {
			<-ctx.Done()
			stopGossip()
		}()
	}
	served := make(chan error, 1)
	go func() { served <- srv.Run(ctx) }()

	// The API answers (503 not ready) while the model loads.
	start := time.Now()
	engine, err := session.New(opts.engine)
	if err != nil {
		stop()
		<-served
		return err
	}
	defer engine.Close()
	engineCtx, stopEngine := context.WithCancel(context.Background())
	engineDone := make(chan error, 1)
	go func() { engineDone <- engine.Run(engineCtx) }()
	local.Set(engine)
	log.Info("model loaded", "model", opts.engine.ModelPath, "took", time.Since(start).Round(time.Millisecond))

	// Shutdown order: the server drains first (the engine keeps serving what is in
	// flight), then the engine stops.
	var err2 error
	select {
	case err := <-served:
		stopEngine()
		err2 = errors.Join(err, <-engineDone)
	case err := <-engineDone: // the engine failed on its own
		stop()
		stopEngine()
		err2 = errors.Join(fmt.Errorf("engine stopped: %w", err), <-served)
	}
	if cluster != nil {
		stopGossip()
		err2 = errors.Join(err2, <-gossipDone, <-gossipDone)
	}
	return err2
}

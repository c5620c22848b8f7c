// Command infernode runs one node of an infernode cluster: it loads a GGUF model and serves
// an OpenAI-compatible API over HTTP.
//
// Every flag can also be set by an environment variable: INFERNODE_ and the flag's name in
// capitals with dashes as underscores (--api-key is INFERNODE_API_KEY). A flag on the
// command line wins over the environment.
package main

import (
	"context"
	"crypto/hkdf"
	"crypto/sha256"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/infernode/infernode/gossip"
	"github.com/infernode/infernode/node"
	"github.com/infernode/infernode/node/hop"
	"github.com/infernode/infernode/node/routing"
	"github.com/infernode/infernode/session"
)

const usage = `infernode runs one node of an infernode cluster: a full replica of a GGUF model
behind an OpenAI-compatible HTTP API.

Usage:
  infernode --model PATH [flags]          run a node
  infernode status [--addr URL] [--watch] print the cluster as one node sees it
  infernode quantize [--type T] IN OUT    write a model's weights as Q8_0, Q4_K_M, ...

Example (the default test model, on port 8080):
  make model && bin/infernode --model models/infernode-tiny.gguf --addr 127.0.0.1:8080
  curl -s localhost:8080/v1/chat/completions -H 'Content-Type: application/json' \
    -d '{"messages":[{"role":"user","content":"hello"}],"max_tokens":16}'

A cluster: give each node --gossip-addr, the same cluster secret, and all but the first
--join FIRST_GOSSIP_ADDR (the secret signs hops between nodes and encrypts gossip):
  export INFERNODE_CLUSTER_SECRET=$(head -c 24 /dev/urandom | base64)
  bin/infernode --model M --addr 127.0.0.1:8081 --gossip-addr 127.0.0.1:7947
  bin/infernode --model M --addr 127.0.0.1:8082 --gossip-addr 127.0.0.1:7948 --join 127.0.0.1:7947

Every flag may also come from the environment: INFERNODE_<NAME>, for example
INFERNODE_MODEL or INFERNODE_API_KEY. Command-line flags win.

Flags:
`

func main() {
	if len(os.Args) > 1 && os.Args[1] == "status" {
		ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
		code := status(ctx, os.Args[2:], os.Stdout, os.Stderr)
		stop()
		os.Exit(code)
	}
	if len(os.Args) > 1 && os.Args[1] == "quantize" {
		os.Exit(quantize(os.Args[2:], os.Stdout, os.Stderr))
	}
	os.Exit(run(os.Args[1:], os.Stderr))
}

// options are the parsed flags.
type options struct {
	node        node.Config
	engine      session.Config
	routing     routing.Config
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
	nc, ec, rc, gc := node.DefaultConfig(), session.DefaultConfig(), routing.DefaultConfig(), gossip.DefaultConfig()
	var gossipAddr, gossipAdvertise, join, gossipKey, secret, accept string
	var insecure bool
	fs := flag.NewFlagSet("infernode", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(stderr, usage)
		fs.PrintDefaults()
	}
	var logFormat, logLevel, maxBody, network string
	var anomalyWindow time.Duration
	var scaleHook string
	fs.StringVar(&ec.ModelPath, "model", "", "GGUF model file to serve (required)")
	fs.StringVar(&nc.ModelName, "model-name", "", "model id clients use (default: the file name without .gguf)")
	fs.StringVar(&nc.ID, "id", "", "node id shown in X-Infernode-Node and logs (default: host-port)")
	fs.StringVar(&nc.Addr, "addr", nc.Addr, "HTTP listen address (port 0 picks a free port; the log says which)")
	fs.StringVar(&nc.APIKey, "api-key", "", "require 'Authorization: Bearer KEY' on /v1/*: the default tenant's key")
	fs.StringVar(&nc.KeyFile, "key-file", "", "more API keys, one 'KEY TENANT' a line, each naming its tenant; reloaded on SIGHUP")
	fs.StringVar(&nc.LimitsFile, "limits", "", "tenants' rate limits, one 'TENANT rpm=N tpm=N burst=S concurrent=N [model=M]' a line, held cluster-wide\n(the same file on every node); reloaded on SIGHUP")
	fs.StringVar(&nc.AdminKey, "admin-key", "", "the operator's key: the only one /v1/cluster, /v1/events and /metrics take (default: --api-key's)")
	fs.BoolVar(&nc.MetricsOpen, "metrics-open", nc.MetricsOpen, "serve /metrics without the API key (for scrapers that carry none)")
	fs.IntVar(&ec.Cells, "ctx", ec.Cells, "KV cache size in tokens, over all sequences")
	fs.IntVar(&ec.SeqContext, "seq-ctx", ec.SeqContext, "most tokens one conversation holds (0: the model's trained context)")
	fs.IntVar(&ec.Sequences, "sequences", ec.Sequences, "requests run at once (prefilled or decoded in the same steps)")
	fs.IntVar(&ec.Conversations, "conversations", ec.Conversations, "conversations held at once, running or cached for their next turn (0: 4x --sequences, or --sequences with --kv-unified=false --kv-host=false)")
	fs.IntVar(&ec.BatchSize, "batch", ec.BatchSize, "tokens per decode step")
	fs.DurationVar(&ec.PrefillSlice, "prefill-slice", ec.PrefillSlice, "longest a step prefills while others decode or wait, at the measured rate (shortest prompt first; not while requests queue for admission)")
	fs.IntVar(&ec.Threads, "threads", ec.Threads, "CPU threads for inference")
	fs.BoolVar(&ec.UnifiedKV, "kv-unified", ec.UnifiedKV, "one KV pool shared by all sequences (false: fixed partitions)")
	fs.BoolVar(&ec.HostKV, "kv-host", ec.HostKV, "move idle conversations' KV cells into host memory until their next turn: out of the unified pool, or out of a partition another conversation needs")
	fs.IntVar(&ec.HostCells, "kv-host-cells", ec.HostCells, "the most tokens of KV --kv-host keeps in host memory (0: as many as --ctx)")
	fs.StringVar(&ec.KVType, "kv-type", ec.KVType, "KV cache type: f16, q8_0 or q4_0")
	fs.BoolVar(&ec.FlashAttn, "flash-attn", ec.FlashAttn, "attention by llama.cpp's flash attention kernel (false: matrix products, faster prefill over long histories with few other conversations in the pool; f16 KV only)")
	fs.BoolVar(&ec.MMap, "mmap", ec.MMap, "map the model file rather than read its weights into memory: starts sooner and shares pages with other processes mapping it, but a file's tensors may lie off the cache lines and decode slower")
	fs.IntVar(&ec.MaxQueue, "max-queue", ec.MaxQueue, "requests that may wait for a sequence")
	fs.DurationVar(&ec.QueueTimeout, "queue-timeout", ec.QueueTimeout, "longest wait for a sequence before 503")
	fs.IntVar(&ec.MaxPromptTokens, "max-prompt-tokens", ec.MaxPromptTokens, "longest prompt accepted (0: the context)")
	fs.IntVar(&ec.DefaultMaxTokens, "default-max-tokens", ec.DefaultMaxTokens, "token limit of requests that set none")
	fs.IntVar(&nc.MaxTokens, "max-tokens", nc.MaxTokens, "largest max_tokens a request may ask for")
	fs.StringVar(&maxBody, "max-body", "4MiB", "largest request body (bytes, or with KiB/MiB)")
	fs.IntVar(&nc.MaxConnsPerIP, "max-conns-per-ip", 0, "connections one client address may hold open, more answered 429 (cluster members exempt; 0: no cap, as behind a load balancer)")
	fs.IntVar(&nc.MaxStreams, "max-streams", nc.MaxStreams, "generation requests in flight on this node, served here or forwarded, before 503 (bounds memory)")
	fs.DurationVar(&nc.RequestTimeout, "request-timeout", nc.RequestTimeout, "deadline of one generation request")
	fs.DurationVar(&nc.WriteTimeout, "write-timeout", nc.WriteTimeout, "cut a client that blocks a write this long")
	fs.DurationVar(&nc.DrainTimeout, "drain-timeout", nc.DrainTimeout, "on SIGTERM, how long running requests may finish")
	fs.Uint64Var(&ec.Seed, "seed", 0, "seed of the engine's random source (0: from the clock; logged)")
	fs.StringVar(&gossipAddr, "gossip-addr", "", "gossip bind host:port; empty runs standalone (no cluster)")
	fs.StringVar(&gossipAdvertise, "gossip-advertise", "", "gossip host:port peers dial (default: the bound address)")
	fs.StringVar(&join, "join", "", "comma-separated gossip addresses of seed peers")
	fs.StringVar(&secret, "cluster-secret", "", "shared secret of the cluster, at least 16 bytes: signs hops between nodes and\nderives the gossip key (required with --gossip-addr unless --insecure)")
	fs.StringVar(&accept, "accept-secrets", "", "comma-separated older or newer cluster secrets also accepted (for rotation)")
	fs.StringVar(&gossipKey, "gossip-key", "", "encrypt gossip with this 16, 24 or 32 byte key instead of one derived from the secret")
	fs.BoolVar(&insecure, "insecure", false, "run a cluster member without a secret: unsigned hops, plain gossip (trusted networks only)")
	fs.StringVar(&rc.HTTPAddr, "advertise-http", "", "HTTP host:port peers use to reach this node (default: the bound address)")
	fs.DurationVar(&rc.ProbeInterval, "probe-interval", rc.ProbeInterval, "how often peers' /readyz are checked")
	fs.StringVar(&network, "network", "lan", "lan, or wan: gossip and peer checks paced for peers a WAN apart (docs/SCALE.md)")
	fs.StringVar(&rc.Role, "role", rc.Role, "what this node does: both (own conversations and prefill them), decode (own them, and have a prefill node prefill a long new prompt when that costs less), or prefill (own none: prefill for the others)")
	fs.BoolVar(&rc.SharePrefixes, "share-prefixes", rc.SharePrefixes, "gossip a digest of the prompt beginnings this node holds, and pull a new conversation's beginning from a peer that holds it instead of prefilling it")
	fs.IntVar(&rc.PlaceMargin, "place-margin", rc.PlaceMargin, "how many more requests than another candidate a conversation's owner runs and queues before it sends a turn there: a new conversation to the least loaded one, a conversation it holds to one that took its replica; and how many more the node it placed a conversation on runs before the owner takes it back (0: never)")
	fs.IntVar(&rc.KV.Replicas, "replicas", rc.KV.Replicas, "nodes that keep a copy of a conversation's KV after each turn, for when its owner fails (0 to 3)")
	fs.DurationVar(&rc.KV.Settle, "kv-settle", rc.KV.Settle, "how long the ring must be quiet before conversations this node no longer owns are pushed to their new owners (a turn sooner pulls)")
	fs.Float64Var(&rc.KV.Bandwidth, "kv-bandwidth", rc.KV.Bandwidth, "Mbit/s this node's KV transfers may use together (0: unbounded)")
	fs.DurationVar(&rc.Stored.TTL, "responses-ttl", rc.Stored.TTL, "how long a stored Responses API response is kept")
	fs.Int64Var(&rc.Stored.MaxBytes, "responses-bytes", rc.Stored.MaxBytes, "bytes of stored responses a node keeps; past it the least recently used go")
	fs.Int64Var(&rc.Answers.MaxBytes, "response-cache-bytes", rc.Answers.MaxBytes, "bytes of whole answers the exact-match response cache keeps (greedy requests that ask for it); 0 turns it off")
	fs.DurationVar(&rc.Answers.TTL, "response-cache-ttl", rc.Answers.TTL, "how long the response cache serves an answer")
	fs.StringVar(&scaleHook, "scale-hook", "", "command run (sh -c) when the autoscaler wants another node count, on the one node that fires it,\nwith INFERNODE_CURRENT_NODES and INFERNODE_DESIRED_NODES set (deploy/kubernetes/scale-hook.sh scales the StatefulSet)")
	fs.IntVar(&rc.Scale.Min, "scale-min", rc.Scale.Min, "fewest nodes the autoscaler asks for")
	fs.IntVar(&rc.Scale.Max, "scale-max", rc.Scale.Max, "most nodes the autoscaler asks for")
	fs.Float64Var(&rc.Scale.Queue, "scale-queue", rc.Scale.Queue, "the autoscaler's set point: requests waiting per node")
	fs.Float64Var(&rc.Scale.Busy, "scale-busy", rc.Scale.Busy, "a scale-in leaves at most this share of the cluster's sequence slots in use")
	fs.DurationVar(&rc.Scale.UpCooldown, "scale-up-cooldown", rc.Scale.UpCooldown, "the least time from a change of the wanted node count to a rise")
	fs.DurationVar(&rc.Scale.DownCooldown, "scale-down-cooldown", rc.Scale.DownCooldown, "the least time from a change of the wanted node count to a fall")
	fs.Float64Var(&nc.Anomaly.Threshold, "anomaly-threshold", nc.Anomaly.Threshold, "z-score of a latency against this node's own past that raises an alert")
	fs.DurationVar(&anomalyWindow, "anomaly-window", time.Duration(nc.Anomaly.Window)*nc.Anomaly.Bucket, "how much of its own past a latency is compared with (10s buckets)")
	fs.DurationVar(&nc.Anomaly.Cooldown, "anomaly-cooldown", nc.Anomaly.Cooldown, "the quiet after a latency alert: one bad minute is one alert")
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
	var errs []error
	switch network {
	case "lan":
	case "wan":
		set := map[string]bool{}
		fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
		wan, wg := routing.WANConfig(), gossip.WANConfig()
		rc.ProbeTimeout, rc.ConnectTimeout = wan.ProbeTimeout, wan.ConnectTimeout
		if !set["probe-interval"] {
			rc.ProbeInterval = wan.ProbeInterval
		}
		gc.ProbeInterval, gc.ProbeTimeout, gc.SuspicionMult = wg.ProbeInterval, wg.ProbeTimeout, wg.SuspicionMult
		gc.GossipInterval, gc.GossipNodes, gc.PushPullInterval, gc.MetaInterval = wg.GossipInterval, wg.GossipNodes, wg.PushPullInterval, wg.MetaInterval
	default:
		errs = append(errs, fmt.Errorf("--network must be lan or wan, got %q", network))
	}
	opts := options{node: nc, engine: ec, routing: rc, gossip: gc, logJSON: logFormat == "json"}
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
		opts.gossip.Join = splitList(join)
		errs = append(errs, opts.secure(secret, accept, gossipKey, insecure))
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
	opts.node.DefaultMaxTokens = opts.engine.DefaultMaxTokens // what a request without max_tokens is charged
	if scaleHook != "" {
		opts.routing.ScaleHook = runScaleHook(scaleHook)
	}
	opts.node.Anomaly.Window = int(anomalyWindow / opts.node.Anomaly.Bucket)
	opts.node.Anomaly.MinBuckets = min(opts.node.Anomaly.MinBuckets, opts.node.Anomaly.Window)
	if opts.engine.ModelPath == "" {
		errs = append(errs, errors.New("--model is required (make model writes the default test model)"))
	}
	if opts.node.ModelName == "" {
		opts.node.ModelName = strings.TrimSuffix(filepath.Base(opts.engine.ModelPath), ".gguf")
	}
	return opts, errors.Join(errs...)
}

// secure sets the cluster's keys: the hop key and the gossip key, both derived from the
// cluster secret (HKDF-SHA256, one label each), plus the keys of secrets also accepted
// during a rotation. A cluster member without a secret is refused unless insecure.
func (o *options) secure(secret, accept, gossipKey string, insecure bool) error {
	if gossipKey != "" {
		o.gossip.Key = []byte(gossipKey)
	}
	if secret == "" {
		if !insecure {
			return errors.New("a cluster member needs a cluster secret (--cluster-secret or INFERNODE_CLUSTER_SECRET, the same on every node); " +
				"without one, anyone who reaches its ports could join the cluster and submit requests as a peer. " +
				"Use --insecure to run without one on a trusted network")
		}
		o.routing.Insecure = true
		return nil
	}
	var errs []error
	for i, s := range append([]string{secret}, splitList(accept)...) {
		if len(s) < 16 {
			errs = append(errs, fmt.Errorf("cluster secrets must be at least 16 bytes, got %d", len(s)))
			continue
		}
		hop, gk := deriveKeys(s)
		if i == 0 {
			o.routing.Secret, o.node.IDKey = hop, deriveKey(s, "infernode ids v1")
			if gossipKey == "" {
				o.gossip.Key = gk
			}
			continue
		}
		o.routing.AcceptSecrets = append(o.routing.AcceptSecrets, hop)
		if gossipKey == "" {
			o.gossip.ExtraKeys = append(o.gossip.ExtraKeys, gk)
		}
	}
	return errors.Join(errs...)
}

// runScaleHook runs command, through sh, with the current and desired node counts in its
// environment, one run at a time, for at most a minute; its output goes to the log.
func runScaleHook(command string) func(ctx context.Context, current, desired int) {
	var mu sync.Mutex
	return func(ctx context.Context, current, desired int) {
		mu.Lock()
		defer mu.Unlock()
		ctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, "sh", "-c", command)
		cmd.Env = append(os.Environ(), fmt.Sprintf("INFERNODE_CURRENT_NODES=%d", current), fmt.Sprintf("INFERNODE_DESIRED_NODES=%d", desired))
		out, err := cmd.CombinedOutput()
		slog.Info("scale hook", "current", current, "desired", desired, "err", err, "output", strings.TrimSpace(string(out)))
	}
}

// deriveKeys derives the hop signing key and the gossip encryption key from a cluster
// secret, so one secret is enough and neither key reveals the other.
func deriveKeys(secret string) (hop, gossipKey []byte) {
	return deriveKey(secret, "infernode hop v1"), deriveKey(secret, "infernode gossip v1")
}

// deriveKey derives the key labeled label from a cluster secret (the ids of stored
// responses are signed with one, so that any node can read them).
func deriveKey(secret, label string) []byte {
	k, err := hkdf.Key(sha256.New, []byte(secret), nil, label, 32)
	if err != nil {
		panic(err) // only for lengths over 255*32 bytes
	}
	return k
}

func splitList(s string) []string {
	var out []string
	for _, part := range strings.Split(s, ",") {
		if part = strings.TrimSpace(part); part != "" {
			out = append(out, part)
		}
	}
	return out
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

// newCluster builds this node's gossip membership and router.
func newCluster(opts options, ln net.Listener, local *session.Handle, log *slog.Logger) (*routing.Router, *gossip.Gossip, error) {
	fp, err := session.Fingerprint(opts.engine)
	if err != nil {
		return nil, nil, err
	}
	rc, gc := opts.routing, opts.gossip
	if rc.HTTPAddr == "" {
		rc.HTTPAddr = ln.Addr().String()
		if tcp := ln.Addr().(*net.TCPAddr); tcp.IP.IsUnspecified() {
			return nil, nil, errors.New("--advertise-http is required when listening on all interfaces")
		}
	}
	if err := gossip.ValidateHostPort(rc.HTTPAddr); err != nil {
		return nil, nil, fmt.Errorf("--advertise-http: %w", err)
	}
	rc.Self, rc.Fingerprint, rc.Model, rc.Logger = opts.node.ID, fp, opts.node.ModelName, log
	rc.DefaultMaxTokens, rc.QueueCap = opts.engine.DefaultMaxTokens, opts.engine.MaxQueue
	gc.ID, gc.Logger, gc.Schema = opts.node.ID, log, routing.Schema
	tags, err := routing.Meta{ID: rc.Self, HTTPAddr: rc.HTTPAddr, Fingerprint: fp, Hop: hop.Versions}.Encode()
	if err != nil {
		return nil, nil, err
	}
	g, err := gossip.New(gc, tags)
	if err != nil {
		return nil, nil, err
	}
	router, err := routing.New(rc, g, local)
	if err != nil {
		return nil, nil, err
	}
	if rc.Insecure {
		log.Warn("running insecure: hops are unsigned and gossip is not encrypted; use --cluster-secret outside a trusted network")
	}
	log.Info("clustered", "fingerprint", fp, "gossip", fmt.Sprintf("%s:%d", gc.BindAddr, gc.BindPort), "join", gc.Join,
		"secured", !rc.Insecure)
	return router, g, nil
}

// serve runs the node until SIGINT or SIGTERM, then drains and exits.

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

	local := &session.Handle{}
	var router *routing.Router
	var g *gossip.Gossip
	cluster, err := node.StandaloneWith(local, opts.node.ModelName, opts.routing.Stored, opts.routing.Answers)
	if err != nil {
		ln.Close()
		return err
	}
	if opts.joinCluster {
		if router, g, err = newCluster(opts, ln, local, log); err != nil {
			ln.Close()
			return err
		}
		cluster = router
	}
	srv, err := node.New(opts.node, local, cluster)
	if err != nil {
		ln.Close()
		return err
	}
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	go func() {
		for range hup {
			if err := srv.ReloadKeys(); err != nil {
				log.Error("SIGHUP: keys not reloaded; the keys in force stay", "err", err)
			}
		}
	}()
	// On SIGTERM: leave gossip first (peers stop routing here at once), then drain.
	gossipCtx, stopGossip := context.WithCancel(context.Background())
	defer stopGossip()
	gossipDone := make(chan error, 2)
	if router != nil {
		go func() { gossipDone <- g.Run(gossipCtx) }()
		go func() { gossipDone <- router.Run(gossipCtx) }()
		go func() {
			<-ctx.Done()
			stopGossip()
		}()
	}
	served := make(chan error, 1)
	go func() { served <- srv.Run(ctx) }()

	// The API answers (503 not ready) while the model loads.
	start := time.Now()
	opts.engine.LoadProgress = loadProgress(log, start)
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
	case err := <-served: // drained, its caches handed off
		stopEngine()
		err2 = errors.Join(err, <-engineDone)
	case err := <-engineDone: // the engine failed on its own
		stop()
		stopEngine()
		err2 = errors.Join(fmt.Errorf("engine stopped: %w", err), <-served)
	}
	if router != nil {
		stopGossip()
		err2 = errors.Join(err2, <-gossipDone, <-gossipDone)
	}
	return err2
}

// loadProgress logs a model's load a step at every tenth, once it has taken a second (a
// small model loads silently).
func loadProgress(log *slog.Logger, start time.Time) func(float32) {
	last := -1
	return func(f float32) {
		step := int(f * 10)
		if step == last || time.Since(start) < time.Second {
			return
		}
		last = step
		log.Info("loading model", "done", fmt.Sprintf("%d%%", 10*step), "elapsed", time.Since(start).Round(100*time.Millisecond))
	}
}

package testbed

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/infernode/infernode/internal/measure"
	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// The autoscaling scenario (testbed autoscale): a load ramp from half of one node's
// capacity to several times it and back, on a cluster whose scale hook the testbed
// implements by starting and stopping real nodes, each held to a share of one CPU so that
// on one small machine a new node really adds capacity. Three tenants: "trial"
// (interactive) and "bulk" (batch priority) are driven at twice their rate limits
// throughout, so their limits bind for the whole run; "web" (interactive, no limit) makes
// up the rest of the ramp's load.

// Autoscale configures the scenario. DefaultAutoscale fills it.
type Autoscale struct {
	Seed      uint64
	Start     int           // nodes at the start, and the fewest the controller may ask for
	Max       int           // the most nodes it may ask for
	CPU       int           // percent of one CPU each node gets
	CPUPeriod time.Duration // the period that share is given in (LimitCPU)
	Sequences int           // each node's sequence slots
	Ramp      []float64     // the load at each stage, in multiples of one node's capacity
	Stage     time.Duration // each stage's length
	MaxTokens int           // each answer's length
	// SetPoint is the controller's: requests waiting per node (--scale-queue).
	SetPoint float64
	// UpCooldown and DownCooldown are the controller's cool-downs; Busy, the share of
	// slots a scale-in may leave in use (--scale-busy).
	UpCooldown, DownCooldown time.Duration
	Busy                     float64
	// Trial and Bulk are those tenants' limits, in multiples of one node's capacity.
	Trial, Bulk float64
	// TTFTFactor sets the interactive first-token target: this many times the p99 of
	// interactive requests alone at half of one node's capacity (1.5: the priority
	// classes' bound, which batch work beside them must not break).
	TTFTFactor float64
	// ScaleOutWithin bounds the time from the queue passing its set point to the hook
	// asking for more nodes (the controller runs every 5 s on gossiped load, and one
	// sample inside the dead band may pass first); RecoverWithin, from the last node added becoming ready to the
	// interactive p99 back under its target.
	ScaleOutWithin, RecoverWithin time.Duration
	// CalibrateOnly stops after the calibration (a node's capacity, interactive first
	// tokens alone and beside batch work), with the batch check alone.
	CalibrateOnly bool
}

// DefaultAutoscale is the scenario as docs/BENCHMARKS.md reports it.
func DefaultAutoscale(seed uint64) Autoscale {
	return Autoscale{Seed: seed, Start: 1, Max: 6, CPU: 20, CPUPeriod: 10 * time.Millisecond, Sequences: 4,
		Ramp:  []float64{0.5, 1, 2, 3, 4, 4, 3, 2, 1, 0.5, 0.5},
		Stage: 30 * time.Second, MaxTokens: 32, SetPoint: 0.5, UpCooldown: 10 * time.Second, DownCooldown: 45 * time.Second, Busy: 0.5,
		Trial: 0.1, Bulk: 0.2, TTFTFactor: 1.5, ScaleOutWithin: 30 * time.Second, RecoverWithin: 45 * time.Second}
}

// AutoscaleReport is what the scenario measured.
type AutoscaleReport struct {
	Seed       uint64        `json:"seed"`
	Started    time.Time     `json:"started"`
	Took       time.Duration `json:"took_ns"`
	Config     Autoscale     `json:"config"`
	Capacity   float64       `json:"capacity_requests_per_s"` // one CPU-limited node's, closed loop
	CPUBackend string        `json:"cpu_backend"`             // how LimitCPU held them to it
	// Alone and WithBatch are interactive first-token p50 and p99 on the calibration's
	// nodes at half their capacity, alone and with batch work filling the rest; AloneAgain
	// is the alone phase run once more, the same arrivals (an A/A test: how far apart
	// chance alone puts two measurements of one thing).
	Alone      [2]time.Duration   `json:"interactive_ttft_alone_ns"`
	AloneAgain [2]time.Duration   `json:"interactive_ttft_alone_again_ns"`
	WithBatch  [2]time.Duration   `json:"interactive_ttft_with_batch_ns"`
	BatchDone  int                `json:"batch_completed_beside"`
	Target     time.Duration      `json:"ttft_target_ns"`
	Limits     map[string]float64 `json:"limits_rpm"`
	// Leases is what the nodes' rate limiters did, summed over every node before it left
	// and at the end: leases granted, denied and failed (owner unreachable).
	Leases   map[string]float64 `json:"quota_leases"`
	Tenants  map[string]*Tenant `json:"tenants"`
	Samples  []ScaleSample      `json:"samples"`
	Events   []ScaleEvent       `json:"events"`
	Requests []LoadRecord       `json:"requests"`
	// Calibration is the calibration's interactive requests, tenant "web alone", "web
	// alone again" or "web beside batch" (the batch check's phases), for reading its tail.
	Calibration []LoadRecord `json:"calibration"`
	Checks      []Check      `json:"checks"`
}

// Tenant is what one tenant sent and got.
type Tenant struct {
	Sent, OK, Limited, Failed int
	// Admitted is the requests the rate limiter let through a minute (everything but
	// 429s), over the whole load.
	Admitted float64 `json:"admitted_per_minute"`
}

// ScaleSample is the cluster once a second, as its first node sees it.
type ScaleSample struct {
	Time    time.Time `json:"time"`
	Serving int       `json:"serving"` // nodes taking requests (the testbed's view)
	Ring    int       `json:"ring"`    // nodes on the ring
	Waiting int       `json:"waiting"` // requests waiting, summed over the gossiped loads
	Running int       `json:"running"`
	KV      float64   `json:"kv_used"` // the controller's last inputs and output
	Desired int       `json:"desired"`
	Error   float64   `json:"error"`
	Output  float64   `json:"output"`
}

// ScaleEvent is a hook call or a node's start, readiness, leave or exit.
type ScaleEvent struct {
	Time    time.Time `json:"time"`
	Kind    string    `json:"kind"` // hook, start, ready, leave, gone
	Node    string    `json:"node,omitempty"`
	Current int       `json:"current,omitempty"`
	Desired int       `json:"desired,omitempty"`
	Detail  string    `json:"detail,omitempty"`
}

// LoadRecord is one request of the scenario's load.
type LoadRecord struct {
	Tenant string        `json:"tenant"`
	Entry  string        `json:"entry"`
	Served string        `json:"served,omitempty"` // the node that answered (X-Infernode-Node)
	Start  time.Time     `json:"start"`
	End    time.Time     `json:"end"`
	TTFT   time.Duration `json:"ttft_ns"`
	Status int           `json:"status"`
	Kind   string        `json:"kind"`
	Error  string        `json:"error,omitempty"`
}

func (r LoadRecord) limited() bool     { return r.Status == 429 }
func (r LoadRecord) interactive() bool { return r.Tenant != "bulk" }

// limitBurst is the limited tenants' burst, in seconds of their rate: at a few requests a
// minute the default 3 s is under two requests, and a bucket that small, full between
// two Poisson arrivals, wastes its refill (at twice the limit about a tenth of it).
const limitBurst = 10

// autoscaleKeys are the tenants' API keys.
var autoscaleKeys = map[string]string{"web": "key-of-tenant-web-0001", "trial": "key-of-tenant-trial-02", "bulk": "key-of-tenant-bulk-003"}

// RunAutoscale measures one node's capacity, then runs the ramp on a cluster that the
// controller grows and shrinks, and checks the outcome.
func RunAutoscale(ctx context.Context, cfg Config, a Autoscale) (*AutoscaleReport, error) {
	rep := &AutoscaleReport{Seed: a.Seed, Config: a, Started: time.Now(), Tenants: map[string]*Tenant{}, Leases: map[string]float64{}}
	keys, batch, err := tenantFiles(cfg.LogDir)
	if err != nil {
		return nil, err
	}
	cfg.APIKey = "key-of-the-testbed-0001"
	node := []string{"--threads", "1", "--sequences", strconv.Itoa(a.Sequences), "--ctx", "4096", "--key-file", keys}

	// Three nodes: what one node adds to a cluster (forwarding, two requests in three,
	// and KV replicas included: a node measured alone would promise more than it adds),
	// and interactive first tokens at half their capacity with and without batch work
	// beside them.
	three := cfg
	three.Nodes, three.Args = 3, append(slices.Clone(cfg.Args), append(node, "--limits", batch)...)
	if err := rep.calibrate(ctx, three, a); err != nil {
		return nil, err
	}
	rep.Target = time.Duration(a.TTFTFactor * float64(rep.Alone[1]))
	if a.CalibrateOnly {
		rep.Checks = []Check{rep.batchCheck()}
		rep.Took = time.Since(rep.Started)
		return rep, nil
	}
	rep.Limits = map[string]float64{"trial": math.Round(a.Trial * rep.Capacity * 60), "bulk": math.Round(a.Bulk * rep.Capacity * 60)}
	limits := filepath.Join(cfg.LogDir, "limits")
	if err := os.WriteFile(limits, fmt.Appendf(nil, "trial rpm=%.0f burst=%d\nbulk rpm=%.0f burst=%d priority=batch\n", rep.Limits["trial"], limitBurst, rep.Limits["bulk"], limitBurst), 0o600); err != nil {
		return nil, err
	}

	// The cluster, with the testbed as its scale hook.
	hookLog := filepath.Join(cfg.LogDir, "hook.log")
	os.Remove(hookLog)
	cfg.Nodes = a.Start
	cfg.Args = append(slices.Clone(cfg.Args), append(node, "--limits", limits,
		"--scale-hook", fmt.Sprintf(`printf '%%s %%s\n' "$INFERNODE_CURRENT_NODES" "$INFERNODE_DESIRED_NODES" >> %s`, hookLog),
		"--scale-min", strconv.Itoa(a.Start), "--scale-max", strconv.Itoa(a.Max), "--scale-queue", fmt.Sprint(a.SetPoint),
		"--scale-up-cooldown", a.UpCooldown.String(), "--scale-down-cooldown", a.DownCooldown.String(), "--scale-busy", fmt.Sprint(a.Busy))...)
	c, err := Start(ctx, cfg)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	p := &pool{c: c, a: a, rep: rep}
	for _, n := range c.Nodes {
		limitCPU(n, a)
	}
	if _, err := c.WaitRings(ctx, c.IDs(), 60*time.Second); err != nil {
		return nil, err
	}

	runCtx, stop := context.WithCancel(ctx)
	var bg sync.WaitGroup
	bg.Go(func() { p.follow(runCtx, hookLog) })
	bg.Go(func() { p.sample(runCtx) })
	rep.Requests = p.load(ctx, rep)
	stop()
	bg.Wait()
	p.settle()
	for _, n := range p.active() {
		p.countLeases(n)
	}
	rep.Took = time.Since(rep.Started)
	rep.check()
	return rep, nil
}

// calibrate measures a few CPU-limited nodes: their capacity with as many clients as they
// have slots, each client's requests entering at every node in turn (nothing waits, so
// nothing a controller would act on); its share a node is one node's. Then interactive
// requests arriving at half the nodes' capacity: alone, alone again (the check's noise
// floor), and with batch clients keeping every slot busy.
func (rep *AutoscaleReport) calibrate(ctx context.Context, cfg Config, a Autoscale) error {
	c, err := Start(ctx, cfg)
	if err != nil {
		return err
	}
	defer c.Close()
	for _, n := range c.Nodes {
		rep.CPUBackend = limitCPU(n, a)
	}
	if _, err := c.WaitRings(ctx, c.IDs(), time.Minute); err != nil {
		return fmt.Errorf("calibration nodes: %w", err)
	}
	// A capacity is a mean of many answers; a p99 is set by the few tightest bursts of
	// Poisson arrivals (at half the capacity, 450-750 arrivals in 40 s on this project's
	// machines: the p99 is their fifth to eighth longest first token, and ten calibrations
	// put the ratio of two such p99s anywhere from 0.76 to 1.99). The interactive phases
	// run twice as long.
	const phase, interactivePhase = 40 * time.Second, 80 * time.Second
	start := time.Now()
	timeUp := make(chan struct{})
	time.AfterFunc(phase, func() { close(timeUp) })
	completed := closedLoop(ctx, c.Nodes, "web", len(c.Nodes)*a.Sequences, a.MaxTokens, timeUp)
	rep.Capacity = float64(completed) / time.Since(start).Seconds() / float64(len(c.Nodes))
	if rep.Capacity <= 0 {
		return fmt.Errorf("calibration completed nothing")
	}
	// Interactive arrivals at half the nodes' capacity, open loop: their first tokens
	// alone, alone again, then beside batch clients. Every phase draws the same arrival
	// times, entry nodes and conversation ids, so the same nodes serve them (a paired
	// comparison: the p99 of some 1,000 first tokens is set by the few seconds in which
	// a burst of arrivals lands on one node and fills its sequences, and with the
	// conversations keyed by their prompts those seconds fell at other times in each
	// phase), with prompts of their own that differ from their first token (no phase finds
	// another's in a cache).
	phases := 0
	interactive := func(label string) []time.Duration {
		phases++
		phase := phases
		rng := rand.New(rand.NewPCG(a.Seed, 1))
		client := tenantClient("web")
		var mu sync.Mutex
		var ttfts []time.Duration
		var reqs sync.WaitGroup
		start := time.Now()
		rate := rep.Capacity * float64(len(c.Nodes)) / 2
		for at := time.Duration(0); at < interactivePhase; at += time.Duration(rng.ExpFloat64() / rate * float64(time.Second)) {
			time.Sleep(time.Until(start.Add(at)))
			n := c.Nodes[rng.IntN(len(c.Nodes))]
			reqs.Go(func() {
				r := loadRequest(ctx, client, n, "web", fmt.Sprintf("%d. web calibrates %d (%s)", phase, at, label), fmt.Sprint("calibration-", at), a.MaxTokens)
				r.Tenant = "web " + label
				mu.Lock()
				defer mu.Unlock()
				rep.Calibration = append(rep.Calibration, r)
				if r.Kind == "ok" {
					ttfts = append(ttfts, r.TTFT)
				}
			})
		}
		reqs.Wait()
		return ttfts
	}
	alone := interactive("alone")
	rep.Alone = [2]time.Duration{measure.Percentile(alone, 50), measure.Percentile(alone, 99)}
	again := interactive("alone again")
	rep.AloneAgain = [2]time.Duration{measure.Percentile(again, 50), measure.Percentile(again, 99)}
	stop := make(chan struct{})
	batchDone := make(chan int)
	go func() { batchDone <- closedLoop(ctx, c.Nodes, "bulk", 2*len(c.Nodes)*a.Sequences, a.MaxTokens, stop) }()
	beside := interactive("beside batch")
	close(stop)
	rep.BatchDone = <-batchDone
	rep.WithBatch = [2]time.Duration{measure.Percentile(beside, 50), measure.Percentile(beside, 99)}
	return nil
}

// tenantFiles writes the scenario's key file (autoscaleKeys) and a limits file that gives
// the bulk tenant batch priority into dir.
func tenantFiles(dir string) (keys, batch string, err error) {
	var lines []string
	for tenant, key := range autoscaleKeys {
		lines = append(lines, key+" "+tenant)
	}
	keys, batch = filepath.Join(dir, "keys"), filepath.Join(dir, "batch")
	if err := os.WriteFile(keys, []byte(strings.Join(lines, "\n")+"\n"), 0o600); err != nil {
		return "", "", err
	}
	if err := os.WriteFile(batch, []byte("bulk priority=batch\n"), 0o600); err != nil {
		return "", "", err
	}
	return keys, batch, nil
}

// closedLoop runs clients of tenant, each sending its next chat of maxTokens as soon as
// the last one ends, over nodes in turn, until until closes; it returns how many were
// answered.
func closedLoop(ctx context.Context, nodes []*Node, tenant string, clients, maxTokens int, until <-chan struct{}) int {
	var done sync.WaitGroup
	var completed atomic.Int64
	client := tenantClient(tenant)
	for i := range clients {
		done.Go(func() {
			for k := 0; ; k++ {
				select {
				case <-until:
					return
				default:
				}
				n := nodes[(i+k)%len(nodes)]
				if r := loadRequest(ctx, client, n, tenant, fmt.Sprintf("%s calibrates %d-%d", tenant, i, k), "", maxTokens); r.Kind == "ok" {
					completed.Add(1)
				}
			}
		})
	}
	done.Wait()
	return int(completed.Load())
}

// limitCPU holds n to the scenario's CPU share and returns how; a node it could not
// limit runs on, said on stderr.
func limitCPU(n *Node, a Autoscale) string {
	backend, err := n.LimitCPU(a.CPU, a.CPUPeriod)
	if err != nil {
		fmt.Fprintf(os.Stderr, "autoscale: %s: %v\n", n.ID, err)
	}
	return backend
}

// pool is the scenario's nodes, grown and shrunk as the hook asks.
type pool struct {
	c   *Cluster
	a   Autoscale
	rep *AutoscaleReport

	mu      sync.Mutex // guards c.Nodes, rep.Events and rep.Samples while the load runs
	leaving sync.WaitGroup
}

func (p *pool) event(e ScaleEvent) {
	e.Time = time.Now()
	p.mu.Lock()
	p.rep.Events = append(p.rep.Events, e)
	p.mu.Unlock()
}

// active is the nodes running and not told to leave, the first first.
func (p *pool) active() []*Node {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.DeleteFunc(slices.Clone(p.c.Nodes), func(n *Node) bool { return !n.Running() || n.isLeaving() })
}

// entries is the nodes a client's load balancer would send to (see Node.Serving).
func (p *pool) entries() []*Node {
	p.mu.Lock()
	nodes := slices.Clone(p.c.Nodes)
	p.mu.Unlock()
	return slices.DeleteFunc(nodes, func(n *Node) bool { return !n.Serving() })
}

// follow reads the hook's lines ("current desired") as nodes append them and scales the
// pool to each desired count: new nodes held to the CPU share, the newest nodes leaving
// gracefully (SIGTERM: drain and hand their KV on).
func (p *pool) follow(ctx context.Context, path string) {
	var read int64
	tick := time.NewTicker(200 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		b, err := os.ReadFile(path)
		if err != nil || int64(len(b)) <= read {
			continue
		}
		chunk := b[read:]
		end := bytes.LastIndexByte(chunk, '\n')
		if end < 0 {
			continue
		}
		read += int64(end + 1)
		for line := range strings.Lines(string(chunk[:end+1])) {
			var current, desired int
			if _, err := fmt.Sscan(line, &current, &desired); err != nil {
				continue
			}
			p.event(ScaleEvent{Kind: "hook", Current: current, Desired: desired})
			p.scaleTo(ctx, max(p.a.Start, min(p.a.Max, desired)))
		}
	}
}

func (p *pool) scaleTo(ctx context.Context, want int) {
	active := p.active()
	for n := len(active); n < want; n++ {
		p.mu.Lock()
		id := fmt.Sprintf("node%d", len(p.c.Nodes)+1)
		node, err := p.c.Add(ctx, id)
		p.mu.Unlock()
		if err != nil {
			p.event(ScaleEvent{Kind: "start", Node: id, Detail: err.Error()})
			return
		}
		limitCPU(node, p.a)
		p.event(ScaleEvent{Kind: "start", Node: id})
		go func() {
			if within(2*time.Minute, node.Serving) {
				p.event(ScaleEvent{Kind: "ready", Node: id})
			}
		}()
	}
	for i := len(active) - 1; i >= want && i > 0; i-- {
		n := active[i]
		p.event(ScaleEvent{Kind: "leave", Node: n.ID})
		p.countLeases(n)
		p.leaving.Go(func() {
			err := n.Stop(2 * time.Minute)
			p.event(ScaleEvent{Kind: "gone", Node: n.ID, Detail: errString(err)})
		})
	}
}

// countLeases adds n's rate-limit lease counts to the report.
func (p *pool) countLeases(n *Node) {
	for _, outcome := range []string{"granted", "denied", "failed"} {
		v, err := p.c.Metric(n, `infernode_quota_leases_total{outcome="`+outcome+`"}`)
		if err != nil {
			continue
		}
		p.mu.Lock()
		p.rep.Leases[outcome] += v
		p.mu.Unlock()
	}
}

// within polls cond every 100 ms until it holds (true) or timeout passes (false).
func within(timeout time.Duration, cond func() bool) bool {
	for deadline := time.Now().Add(timeout); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		if cond() {
			return true
		}
	}
	return false
}

// settle waits for the nodes told to leave to be gone.
func (p *pool) settle() { p.leaving.Wait() }

// sample records the cluster once a second, as the first node sees it.
func (p *pool) sample(ctx context.Context) {
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		v, err := p.c.scaleView(p.c.Nodes[0])
		if err != nil {
			continue
		}
		s := ScaleSample{Time: time.Now(), Serving: len(p.entries()), KV: v.Autoscale.KV, Desired: v.Autoscale.Desired,
			Error: v.Autoscale.Error, Output: v.Autoscale.Output}
		for _, m := range v.Members {
			if m.OnRing && m.Compatible {
				s.Ring++
				s.Waiting += m.Load["waiting"]
				s.Running += m.Load["running"]
			}
		}
		p.mu.Lock()
		p.rep.Samples = append(p.rep.Samples, s)
		p.mu.Unlock()
	}
}

// scaleView is a node's /v1/cluster with the autoscaler's part.
func (c *Cluster) scaleView(n *Node) (v struct {
	ClusterView
	Autoscale struct {
		KV      float64 `json:"kv_used"`
		Desired int     `json:"desired"`
		Error   float64 `json:"error"`
		Output  float64 `json:"output"`
	} `json:"autoscale"`
}, err error) {
	return v, c.getJSON(n, "/v1/cluster", &v)
}

// load runs the three tenants' open-loop arrivals (Poisson, seeded) through the ramp, each
// request to a random serving node, and returns every request once all have ended.
func (p *pool) load(ctx context.Context, rep *AutoscaleReport) []LoadRecord {
	a := p.a
	start := time.Now()
	total := time.Duration(len(a.Ramp)) * a.Stage
	rate := map[string]func(time.Duration) float64{
		"web": func(at time.Duration) float64 {
			total := a.Ramp[min(len(a.Ramp)-1, int(at/a.Stage))] * rep.Capacity
			return max(0.1, total-(rep.Limits["trial"]+rep.Limits["bulk"])/60)
		},
		"trial": func(time.Duration) float64 { return 2 * rep.Limits["trial"] / 60 },
		"bulk":  func(time.Duration) float64 { return 2 * rep.Limits["bulk"] / 60 },
	}
	var mu sync.Mutex
	var out []LoadRecord
	var reqs sync.WaitGroup
	var gens sync.WaitGroup
	for i, tenant := range []string{"web", "trial", "bulk"} {
		gens.Go(func() {
			rng := rand.New(rand.NewPCG(a.Seed, uint64(i)))
			client := tenantClient(tenant)
			next := time.Duration(0)
			for k := 0; ; k++ {
				next += time.Duration(rng.ExpFloat64() / rate[tenant](next) * float64(time.Second))
				if next >= total {
					return
				}
				select {
				case <-ctx.Done():
					return
				case <-time.After(time.Until(start.Add(next))):
				}
				entries := p.entries()
				if len(entries) == 0 {
					continue
				}
				entry := entries[rng.IntN(len(entries))]
				prompt := fmt.Sprintf("%s asks for story %d", tenant, k)
				reqs.Go(func() {
					r := loadRequest(ctx, client, entry, tenant, prompt, "", a.MaxTokens)
					mu.Lock()
					out = append(out, r)
					mu.Unlock()
				})
			}
		})
	}
	gens.Wait()
	reqs.Wait()
	slices.SortFunc(out, func(x, y LoadRecord) int { return x.Start.Compare(y.Start) })
	return out
}

// tenantClient is an HTTP client that sends tenant's API key.
func tenantClient(tenant string) *http.Client {
	return &http.Client{Transport: keyed{key: autoscaleKeys[tenant], next: http.DefaultTransport}}
}

type keyed struct {
	key  string
	next http.RoundTripper
}

func (k keyed) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", "Bearer "+k.key)
	return k.next.RoundTrip(r)
}

// loadRequest is one streamed chat of the scenario's load.
func loadRequest(ctx context.Context, client *http.Client, entry *Node, tenant, prompt, session string, maxTokens int) LoadRecord {
	r := request(ctx, client, entry, []message{{"user", prompt}}, maxTokens, true, time.Minute, nil, session)
	lr := LoadRecord{Tenant: tenant, Entry: entry.ID, Served: r.Served, Start: r.Start, End: r.End, TTFT: r.TTFT, Status: r.Status, Kind: r.Kind, Error: r.Error}
	if lr.Kind != "ok" && len(lr.Error) > 300 {
		lr.Error = lr.Error[:300]
	}
	return lr
}

// check asserts the scenario's outcome.
func (rep *AutoscaleReport) check() {
	a := rep.Config
	add := func(name string, pass bool, format string, args ...any) {
		rep.Checks = append(rep.Checks, Check{Name: name, Pass: pass, Detail: fmt.Sprintf(format, args...)})
	}
	if len(rep.Requests) == 0 || len(rep.Samples) == 0 {
		add("ran", false, "%d requests, %d samples", len(rep.Requests), len(rep.Samples))
		return
	}
	loadStart, loadEnd := rep.Requests[0].Start, rep.Requests[0].Start.Add(time.Duration(len(a.Ramp))*a.Stage)
	peakEnd := loadStart.Add(time.Duration(lastPeak(a.Ramp)+1) * a.Stage)

	// Scale-out: the hook asks for more nodes soon after the queue passes its set point,
	// from the second stage on. The first is half a node's capacity, where none is due, and
	// opens with every tenant's rate-limit bucket full: a burst that queued 4 a node for 2
	// s in one run, which the controller's dead band rightly let pass (the queue was at 0
	// for the next 25 s), is not the ramp's load.
	ramped := slices.DeleteFunc(slices.Clone(rep.Samples), func(s ScaleSample) bool { return s.Time.Before(loadStart.Add(a.Stage)) })
	over, ok := firstOver(ramped, a.SetPoint*1.25)
	up, upOK := firstHook(rep.Events, func(e ScaleEvent) bool { return e.Desired > e.Current })
	switch {
	case !ok:
		add("scale-out", false, "the queue never passed its set point (%g waiting a node): the ramp did not load the cluster", a.SetPoint)
	case !upOK:
		add("scale-out", false, "the queue passed its set point at %s and the hook never asked for more nodes", rep.at(over))
	default:
		add("scale-out", up.Sub(over) <= a.ScaleOutWithin, "the queue passed %g waiting a node (the set point and its dead band) over 5 s at %s; the hook asked for more at %s (%v later, bound %v)",
			a.SetPoint*1.25, rep.at(over), rep.at(up), up.Sub(over).Round(time.Second), a.ScaleOutWithin)
	}

	// Recovery: after the last node added on the way up is ready, the interactive p99
	// comes back under its target.
	var lastReady time.Time
	for _, e := range rep.Events {
		if e.Kind == "ready" && e.Time.Before(peakEnd) {
			lastReady = e.Time
		}
	}
	if lastReady.IsZero() {
		add("recovery", false, "no node was added and ready before the peak ended")
	} else {
		back, ok := rep.underTarget(lastReady, peakEnd)
		add("recovery", ok && back.Sub(lastReady) <= a.RecoverWithin, "the last node added on the way up was ready at %s; interactive TTFT p99 over 10 s was under %v from %s (bound %v after)",
			rep.at(lastReady), rep.Target.Round(time.Millisecond), rep.at(back), a.RecoverWithin)
	}

	// Scale-in after the load falls, reversing at most once.
	counts := nodeCounts(rep.Events, a.Start)
	left := slices.ContainsFunc(rep.Events, func(e ScaleEvent) bool { return e.Kind == "leave" && e.Time.After(peakEnd) })
	add("scale-in", left && reversals(counts) <= 1, "node counts %v: %d reversals (at most 1), a leave after the peak: %v", counts, reversals(counts), left)

	// Nothing fails, least of all during scale-in.
	var firstLeave time.Time
	for _, e := range rep.Events {
		if e.Kind == "leave" {
			firstLeave = e.Time
			break
		}
	}
	failed, failedIn := 0, 0
	var sample string
	for _, r := range rep.Requests {
		t := rep.Tenants[r.Tenant]
		if t == nil {
			t = &Tenant{}
			rep.Tenants[r.Tenant] = t
		}
		t.Sent++
		switch {
		case r.Kind == "ok":
			t.OK++
		case r.limited():
			t.Limited++
		default:
			t.Failed++
			failed++
			if !firstLeave.IsZero() && r.End.After(firstLeave) {
				failedIn++
			}
			if sample == "" {
				sample = fmt.Sprintf("%s at %s: %s %d %s", r.Tenant, rep.at(r.Start), r.Kind, r.Status, r.Error)
			}
		}
	}
	add("no failures in scale-in", !firstLeave.IsZero() && failedIn == 0, "%d requests failed from the first leave (%s) on, %d in the whole run (first: %s)",
		failedIn, rep.at(firstLeave), failed, sample)

	// Tenant limits, over the whole load.
	minutes := loadEnd.Sub(loadStart).Minutes()
	for _, tenant := range []string{"trial", "bulk"} {
		t := rep.Tenants[tenant]
		if t == nil {
			add("limit "+tenant, false, "sent nothing")
			continue
		}
		t.Admitted = float64(t.Sent-t.Limited) / minutes
		limit := rep.Limits[tenant]
		add("limit "+tenant, minutes >= 1 && t.Limited > 0 && math.Abs(t.Admitted-limit) <= 0.1*limit,
			"%.0f requests a minute admitted over %.1f minutes (limit %.0f, ±10%%); %d of %d refused with 429", t.Admitted, minutes, limit, t.Limited, t.Sent)
	}
	if web := rep.Tenants["web"]; web != nil {
		web.Admitted = float64(web.Sent-web.Limited) / minutes
	}

	// Batch work does not delay interactive work beyond the bound: on three nodes at half
	// their capacity, and in the ramp once the cluster has the nodes it needs (requests
	// started with no queue over the set point in the RecoverWithin before).
	rep.Checks = append(rep.Checks, rep.batchCheck())
	var settled []time.Duration
	for _, r := range rep.Requests {
		if r.interactive() && r.Kind == "ok" && !rep.strained(r.Start, a.RecoverWithin) {
			settled = append(settled, r.TTFT)
		}
	}
	p99 := measure.Percentile(settled, 99)
	add("settled latency", len(settled) > 0 && p99 <= rep.Target, "interactive TTFT p99 %v over %d requests settled in the ramp (target %v) while bulk was admitted at %.0f a minute",
		p99.Round(time.Millisecond), len(settled), rep.Target.Round(time.Millisecond), rep.Tenants["bulk"].admitted())
}

func (t *Tenant) admitted() float64 {
	if t == nil {
		return 0
	}
	return t.Admitted
}

// at is t as seconds since the report started.
func (rep *AutoscaleReport) at(t time.Time) string {
	if t.IsZero() {
		return "never"
	}
	return fmt.Sprintf("%.0fs", t.Sub(rep.Started).Seconds())
}

// strained reports whether a sample in the d before t had the queue over its set point.
func (rep *AutoscaleReport) strained(t time.Time, d time.Duration) bool {
	for _, s := range rep.Samples {
		if s.Time.After(t.Add(-d)) && !s.Time.After(t) && s.Ring > 0 && float64(s.Waiting)/float64(s.Ring) > rep.Config.SetPoint {
			return true
		}
	}
	return false
}

// underTarget finds the first second from from to to whose trailing 10 s of interactive
// first-token times have a p99 under the target.
func (rep *AutoscaleReport) underTarget(from, to time.Time) (time.Time, bool) {
	for t := from; !t.After(to); t = t.Add(time.Second) {
		if p, n := rep.ttftP99(t.Add(-10*time.Second), t); n >= 5 && p <= rep.Target {
			return t, true
		}
	}
	return time.Time{}, false
}

// ttftP99 is the p99 of the interactive first-token times of requests started in [from,
// to), and how many there were.
func (rep *AutoscaleReport) ttftP99(from, to time.Time) (time.Duration, int) {
	var d []time.Duration
	for _, r := range rep.Requests {
		if r.interactive() && r.Kind == "ok" && !r.Start.Before(from) && r.Start.Before(to) {
			d = append(d, r.TTFT)
		}
	}
	return measure.Percentile(d, 99), len(d)
}

// lastPeak is the index of the last stage at the ramp's highest load.
func lastPeak(ramp []float64) int {
	i := 0
	for j, x := range ramp {
		if x >= ramp[i] {
			i = j
		}
	}
	return i
}

// firstOver is the end of the first 5 s whose mean queue per node is over level: a queue
// the controller, which runs every 5 s on the mean load since its last run, must act on
// (one sample's blip is not).
func firstOver(samples []ScaleSample, level float64) (time.Time, bool) {
	const span = 5
	for i := span - 1; i < len(samples); i++ {
		sum := 0.0
		for _, s := range samples[i-span+1 : i+1] {
			if s.Ring > 0 {
				sum += float64(s.Waiting) / float64(s.Ring)
			}
		}
		if sum/span > level {
			return samples[i].Time, true
		}
	}
	return time.Time{}, false
}

// firstHook is the first hook call that match accepts.
func firstHook(events []ScaleEvent, match func(ScaleEvent) bool) (time.Time, bool) {
	for _, e := range events {
		if e.Kind == "hook" && match(e) {
			return e.Time, true
		}
	}
	return time.Time{}, false
}

// nodeCounts is the pool's size after each start and leave, from start nodes.
func nodeCounts(events []ScaleEvent, start int) []int {
	counts := []int{start}
	n := start
	for _, e := range events {
		switch {
		case e.Kind == "start" && e.Detail == "":
			n++
		case e.Kind == "leave":
			n--
		default:
			continue
		}
		counts = append(counts, n)
	}
	return counts
}

// reversals counts the changes of direction in counts.
func reversals(counts []int) int {
	n, dir := 0, 0
	for i := 1; i < len(counts); i++ {
		d := counts[i] - counts[i-1]
		if d == 0 {
			continue
		}
		if dir != 0 && (d > 0) != (dir > 0) {
			n++
		}
		dir = d
	}
	return n
}

// Summary writes the report as a readable table.
func (rep *AutoscaleReport) Summary(w io.Writer) {
	verdict := "PASS"
	for _, c := range rep.Checks {
		if !c.Pass {
			verdict = "FAIL"
		}
	}
	a := rep.Config
	fmt.Fprintf(w, "autoscale (seed %d): %s in %v\n", rep.Seed, verdict, rep.Took.Round(time.Second))
	fmt.Fprintf(w, "  a node (%d%% of a CPU in every %v, by %s; %d slots) adds %.1f requests/s of %d tokens; three at half their capacity, interactive TTFT p50/p99 %v/%v alone, %v/%v alone again, %v/%v beside batch; target %v\n",
		a.CPU, a.CPUPeriod, rep.CPUBackend, a.Sequences, rep.Capacity, a.MaxTokens, rep.Alone[0].Round(time.Millisecond), rep.Alone[1].Round(time.Millisecond),
		rep.AloneAgain[0].Round(time.Millisecond), rep.AloneAgain[1].Round(time.Millisecond),
		rep.WithBatch[0].Round(time.Millisecond), rep.WithBatch[1].Round(time.Millisecond), rep.Target.Round(time.Millisecond))
	if !a.CalibrateOnly {
		fmt.Fprintf(w, "  ramp %v x capacity, %v a stage; limits %v requests a minute; rate-limit leases %v\n", a.Ramp, a.Stage, rep.Limits, rep.Leases)
	}
	for _, tenant := range []string{"web", "trial", "bulk"} {
		if t := rep.Tenants[tenant]; t != nil {
			fmt.Fprintf(w, "  %-5s sent %d: %d ok, %d 429, %d failed; %.0f a minute admitted\n", tenant, t.Sent, t.OK, t.Limited, t.Failed, t.Admitted)
		}
	}
	for _, e := range rep.Events {
		if e.Kind == "hook" {
			fmt.Fprintf(w, "  %5s hook: %d -> %d\n", rep.at(e.Time), e.Current, e.Desired)
		} else {
			fmt.Fprintf(w, "  %5s %s %s %s\n", rep.at(e.Time), e.Kind, e.Node, e.Detail)
		}
	}
	for _, c := range rep.Checks {
		mark := "ok  "
		if !c.Pass {
			mark = "FAIL"
		}
		fmt.Fprintf(w, "  %s %s: %s\n", mark, c.Name, c.Detail)
	}
}

// batchCheck is the calibration's check: interactive TTFT p99 on three nodes at half their
// capacity, beside batch clients filling the rest, within the target.
// Its detail prints the alone phases' own ratio beside it (an A/A test, see
// docs/BENCHMARKS.md) and says so when that ratio alone lies outside the bound: the
// verdict is then chance's as much as the batch work's.
func (rep *AutoscaleReport) batchCheck() Check {
	chance := float64(rep.AloneAgain[1]) / float64(rep.Alone[1])
	note := ""
	if f := rep.Config.TTFTFactor; chance > f || chance < 1/f {
		note = "; the two alone phases differ by more than the bound, so this verdict is chance's as much as the batch work's"
	}
	return Check{Name: "batch beside interactive", Pass: rep.BatchDone > 0 && rep.WithBatch[1] <= rep.Target,
		Detail: fmt.Sprintf("three nodes, interactive at half their capacity: TTFT p99 %v alone, %v with batch clients filling the rest (%.2fx, %d batch answers; bound %.1fx; alone again %v, %.2fx by chance%s)",
			rep.Alone[1].Round(time.Millisecond), rep.WithBatch[1].Round(time.Millisecond), float64(rep.WithBatch[1])/float64(rep.Alone[1]), rep.BatchDone, rep.Config.TTFTFactor,
			rep.AloneAgain[1].Round(time.Millisecond), chance, note)}
}

// Passed reports whether every check held.
func (rep *AutoscaleReport) Passed() bool {
	return len(rep.Checks) > 0 && !slices.ContainsFunc(rep.Checks, func(c Check) bool { return !c.Pass })
}

// Save writes the report as JSON and its timeline as a PNG into dir.
func (rep *AutoscaleReport) Save(dir string) error {
	b, err := json.MarshalIndent(rep, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "report.json"), b, 0o644); err != nil {
		return err
	}
	return rep.Plot(filepath.Join(dir, "timeline.png"))
}

// Plot draws the run's timeline into a PNG at path, five panels on one time axis: nodes
// serving and wanted (with hook calls marked), the queue per node against its set point
// and the KV share held by running requests, the controller's error and output,
// interactive TTFT p50 and p99 over 10 s against the target, and each tenant's 429s a
// second.
func (rep *AutoscaleReport) Plot(path string) error {
	secs := func(t time.Time) float64 { return t.Sub(rep.Started).Seconds() }
	line := func(p *plot.Plot, name string, xys plotter.XYs, c int, dashed bool) error {
		if len(xys) == 0 {
			return nil
		}
		l, err := plotter.NewLine(xys)
		if err != nil {
			return err
		}
		l.Color, l.Width = plotutilColor(c), vg.Points(1.5)
		if dashed {
			l.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
		}
		p.Add(l)
		p.Legend.Add(name, l)
		return nil
	}
	series := func(f func(ScaleSample) float64) plotter.XYs {
		var xys plotter.XYs
		for _, s := range rep.Samples {
			xys = append(xys, plotter.XY{X: secs(s.Time), Y: f(s)})
		}
		return xys
	}
	flat := func(y float64) plotter.XYs {
		if len(rep.Samples) == 0 {
			return nil
		}
		return plotter.XYs{{X: secs(rep.Samples[0].Time), Y: y}, {X: secs(rep.Samples[len(rep.Samples)-1].Time), Y: y}}
	}
	perNode := func(s ScaleSample) float64 {
		if s.Ring == 0 {
			return 0
		}
		return float64(s.Waiting) / float64(s.Ring)
	}
	panel := func(title, y string) *plot.Plot {
		p := plot.New()
		p.Title.Text, p.Y.Label.Text = title, y
		p.Legend.Top, p.Legend.Left = true, true
		return p
	}
	var errs []error
	nodes := panel(fmt.Sprintf("autoscale (seed %d): one node %.1f requests/s; ramp %v x that, %v a stage", rep.Seed, rep.Capacity, rep.Config.Ramp, rep.Config.Stage), "nodes")
	errs = append(errs, line(nodes, "serving", series(func(s ScaleSample) float64 { return float64(s.Serving) }), 0, false),
		line(nodes, "on the ring", series(func(s ScaleSample) float64 { return float64(s.Ring) }), 2, true),
		line(nodes, "wanted (controller)", series(func(s ScaleSample) float64 { return float64(s.Desired) }), 1, false))
	var hooks plotter.XYs
	for _, e := range rep.Events {
		if e.Kind == "hook" {
			hooks = append(hooks, plotter.XY{X: secs(e.Time), Y: float64(e.Desired)})
		}
	}
	if len(hooks) > 0 {
		sc, err := plotter.NewScatter(hooks)
		errs = append(errs, err)
		if err == nil {
			sc.Color = plotutilColor(3)
			nodes.Add(sc)
			nodes.Legend.Add("hook called", sc)
		}
	}
	queue := panel("", "waiting a node · KV")
	errs = append(errs, line(queue, "requests waiting a node", series(perNode), 0, false),
		line(queue, "set point", flat(rep.Config.SetPoint), 3, true),
		line(queue, "KV share held by running requests", series(func(s ScaleSample) float64 { return s.KV }), 2, false))
	ctl := panel("", "controller")
	errs = append(errs, line(ctl, "error", series(func(s ScaleSample) float64 { return s.Error }), 0, false),
		line(ctl, "output", series(func(s ScaleSample) float64 { return s.Output }), 1, false))
	lat := panel("", "TTFT (s)")
	var p50, p99 plotter.XYs
	limited := map[string]plotter.XYs{}
	if len(rep.Requests) > 0 {
		from, to := rep.Requests[0].Start, rep.Requests[len(rep.Requests)-1].Start
		for t := from.Add(10 * time.Second); !t.After(to); t = t.Add(2 * time.Second) {
			var d []time.Duration
			count := map[string]int{}
			for _, r := range rep.Requests {
				if r.Start.Before(t.Add(-10*time.Second)) || !r.Start.Before(t) {
					continue
				}
				if r.interactive() && r.Kind == "ok" {
					d = append(d, r.TTFT)
				}
				if r.limited() {
					count[r.Tenant]++
				}
			}
			if len(d) > 0 {
				p50 = append(p50, plotter.XY{X: secs(t), Y: measure.Percentile(d, 50).Seconds()})
				p99 = append(p99, plotter.XY{X: secs(t), Y: measure.Percentile(d, 99).Seconds()})
			}
			for _, tenant := range []string{"web", "trial", "bulk"} {
				limited[tenant] = append(limited[tenant], plotter.XY{X: secs(t), Y: float64(count[tenant]) / 10})
			}
		}
	}
	errs = append(errs, line(lat, "interactive p50 (10 s)", p50, 0, false), line(lat, "interactive p99 (10 s)", p99, 1, false),
		line(lat, "target", flat(rep.Target.Seconds()), 3, true))
	lim := panel("", "429s a second")
	lim.X.Label.Text = "seconds since the scenario started"
	for i, tenant := range []string{"web", "trial", "bulk"} {
		errs = append(errs, line(lim, tenant, limited[tenant], i, false))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("plot %s: %w", path, err)
	}
	panels := []*plot.Plot{nodes, queue, ctl, lat, lim}
	lo, hi := math.Inf(1), math.Inf(-1)
	for _, p := range panels {
		lo, hi = min(lo, p.X.Min), max(hi, p.X.Max)
	}
	rows := make([][]*plot.Plot, len(panels))
	for i, p := range panels {
		p.X.Min, p.X.Max = lo, hi
		rows[i] = []*plot.Plot{p}
	}
	img := vgimg.New(12*vg.Inch, 14*vg.Inch)
	tiles := draw.Tiles{Rows: len(panels), Cols: 1, PadTop: vg.Points(4), PadBottom: vg.Points(4), PadX: vg.Points(4), PadY: vg.Points(8)}
	canvases := plot.Align(rows, tiles, draw.New(img))
	for i, p := range panels {
		p.Draw(canvases[i][0])
	}
	return savePNG(img, path)
}

package routing

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/infernode/infernode/node/scale"
)

// Autoscaling without a coordinator (see node/scale): every node runs the controller on
// the load its peers gossip, so every node computes about the same desired count (the
// metric infernode_desired_nodes, for Kubernetes autoscalers); the owner of scaleKey on
// the ring fires Config.ScaleHook when the count it wants differs from the ring's.

// scaleKey names the node that fires the hook: whoever owns it on the ring.
const scaleKey = "infernode:autoscale"

// scaleEvery is how often the controller runs; refire, how long a count asked for may go
// unheeded before the hook is asked again (a hook may fail, or its scaler be busy).
const (
	scaleEvery = 5 * time.Second
	refire     = time.Minute
)

type autoscaler struct {
	ctl                     *scale.Controller
	fired                   int // the count the hook was last asked for, at firedAt
	firedAt                 time.Time
	nodes                   int // the ring's size at the last run
	desired, error_, output prometheus.Gauge

	mu      sync.Mutex
	last    AutoscaleView // the last run's, for View
	samples []scale.Load  // the load since the last run, a sample a probe
}

func newAutoscaler(cfg scale.Config) *autoscaler {
	g := func(name, help string) prometheus.Gauge {
		return prometheus.NewGauge(prometheus.GaugeOpts{Name: name, Help: help})
	}
	return &autoscaler{ctl: scale.New(cfg),
		desired: g("infernode_desired_nodes", "Nodes the autoscaling controller wants for this model's ring, as this node computes it from gossiped load."),
		error_:  g("infernode_autoscale_error", "The controller's relative error: requests waiting per node against the set point (0: within the dead band)."),
		output:  g("infernode_autoscale_output", "The controller's output: the relative change of the node count it asks for."),
	}
}

func (a *autoscaler) collectors() []prometheus.Collector {
	return []prometheus.Collector{a.desired, a.error_, a.output}
}

// load is the ring's load as gossiped: its members, the requests running and waiting on
// them and their sequence slots, and their KV cells held by running requests (idle
// conversations' cells may be evicted, so they are no reason to grow).
func (r *Router) load() scale.Load {
	rg := r.v.table.Ring()
	st := r.local.Stats()
	l := scale.Load{}
	r.v.mu.Lock()
	defer r.v.mu.Unlock()
	for _, id := range rg.Members() {
		l.Nodes++
		if id == r.cfg.Self {
			l.Running, l.Waiting, l.Slots = l.Running+float64(st.Running), l.Waiting+float64(st.Waiting), l.Slots+st.Sequences
			l.KVUsed += float64(st.KVActive)
			l.KVCells += st.KVCells
			continue
		}
		m := r.v.members[id].Meta
		l.Running, l.Waiting, l.Slots = l.Running+float64(m.Running), l.Waiting+float64(m.Waiting), l.Slots+m.Slots
		l.KVUsed += float64(m.KVActive)
		l.KVCells += m.KVCells
	}
	return l
}

// observe samples the ring's load for the controller's next run.
func (a *autoscaler) observe(l scale.Load) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.samples = append(a.samples, l)
}

// autoscale runs the controller once on the mean load since its last run (gossiped load
// is an instant: a queue that forms and drains between two runs would otherwise decide
// alone), and fires the hook when this node is the one to.
func (r *Router) autoscale(ctx context.Context) {
	a := r.scale
	a.observe(r.load())
	a.mu.Lock()
	l := scale.Mean(a.samples)
	a.samples = a.samples[:0]
	a.mu.Unlock()
	if l.Nodes == 0 {
		return
	}
	now := r.clock.Now()
	if l.Nodes != a.nodes {
		// The ring changed: what was asked is done, or moot (another node may have fired
		// since, for another count, and left). Every node starts again from the ring.
		if a.nodes != 0 {
			a.ctl.Follow(l.Nodes, now)
		}
		a.nodes, a.fired = l.Nodes, 0
	}
	want := a.ctl.Update(l, now)
	a.desired.Set(float64(want))
	a.error_.Set(a.ctl.Error)
	a.output.Set(a.ctl.Output)
	a.mu.Lock()
	kv := 0.0
	if l.KVCells > 0 {
		kv = l.KVUsed / float64(l.KVCells)
	}
	a.last = AutoscaleView{Nodes: l.Nodes, Waiting: l.Waiting, KVUsed: kv, Desired: want, Error: a.ctl.Error, Output: a.ctl.Output}
	a.mu.Unlock()
	owner, ok := r.v.table.Ring().Owner(scaleKey)
	if r.cfg.ScaleHook == nil || !ok || owner != r.cfg.Self || want == l.Nodes || (want == a.fired && now.Sub(a.firedAt) < refire) {
		return
	}
	a.fired, a.firedAt = want, now
	r.log.Info("autoscale", "nodes", l.Nodes, "desired", want, "waiting", l.Waiting, "kv_used", kv, "error", a.ctl.Error)
	r.v.events.add("autoscale", r.cfg.Self, fmt.Sprintf("%d nodes, %d wanted (%.1f waiting)", l.Nodes, want, l.Waiting))
	go r.cfg.ScaleHook(ctx, l.Nodes, want)
}

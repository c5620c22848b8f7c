package node

import (
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/infernode/infernode/node/anomaly"
)

// Anomaly alerts (node/anomaly): this node's first-token and inter-token times against
// their own past. An alert is logged, counted, and raised as a cluster event (the
// dashboard's feed marks it); the z-scores are gauges.

// latency series.
const (
	seriesTTFT = "ttft"
	seriesITL  = "itl"
)

type alerts struct {
	d      *anomaly.Detector
	raised *prometheus.CounterVec
}

func newAlerts(cfg anomaly.Config, reg *prometheus.Registry) *alerts {
	a := &alerts{d: anomaly.New(cfg), raised: prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "infernode_anomaly_alerts_total", Help: "Alerts raised because a latency of this node sat far above its own past (a rolling z-score), by series.",
	}, []string{"series"})}
	reg.MustRegister(a.raised)
	for _, name := range []string{seriesTTFT, seriesITL} {
		a.raised.WithLabelValues(name)
		reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "infernode_latency_zscore", Help: "The last bucket's z-score of a latency against this node's own past (0 until calibrated).",
			ConstLabels: prometheus.Labels{"series": name},
		}, func() float64 { return a.d.Z(name) }))
	}
	return a
}

// observeTTFT records a first token's time since c arrived.
func (s *Server) observeTTFT(c *completion, d time.Duration) {
	s.metrics.ttft.WithLabelValues(c.endpoint).Observe(d.Seconds())
	s.observeLatency(seriesTTFT, d)
}

// observeITL records a gap between a stream's pieces.
func (s *Server) observeITL(d time.Duration) {
	s.metrics.itl.Observe(d.Seconds())
	s.observeLatency(seriesITL, d)
}

func (s *Server) observeLatency(series string, d time.Duration) {
	a := s.alerts.d.Observe(series, d.Seconds(), time.Now())
	if a == nil {
		return
	}
	s.alerts.raised.WithLabelValues(series).Inc()
	detail := fmt.Sprintf("%s z=%.1f: %v against %v before", series, a.Z,
		time.Duration(a.Mean*float64(time.Second)).Round(time.Millisecond), time.Duration(a.Baseline*float64(time.Second)).Round(time.Millisecond))
	s.log.Warn("latency anomaly", "series", series, "z", a.Z, "mean", a.Mean, "baseline", a.Baseline)
	s.cluster.Happened("anomaly", detail)
}

package testbed

import (
	"fmt"
	"image/color"
	"os"
	"slices"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// RingSample is one node's ring size at one moment of a run.
type RingSample struct {
	Node    string    `json:"node"`
	Time    time.Time `json:"time"`
	Size    int       `json:"size"`
	Running int       `json:"running"` // the node's own requests running and waiting then
	Waiting int       `json:"waiting"`
	// Degraded lists the members the node's view marked degraded (gray failures).
	Degraded []string `json:"degraded,omitempty"`
}

// Outcome colours, as Jepsen's timelines: what happened to each request at a glance.
var outcomeColors = map[string]color.RGBA{
	"ok":      {R: 0x2c, G: 0xa0, B: 0x2c, A: 0xff},
	"resumed": {R: 0x1f, G: 0x77, B: 0xb4, A: 0xff},
	"refused": {R: 0xff, G: 0x7f, B: 0x0e, A: 0xff},
	"failed":  {R: 0xd6, G: 0x27, B: 0x28, A: 0xff},
}

func outcome(r Record) string {
	switch {
	case r.Kind == "ok" && r.Resumed:
		return "resumed"
	case r.Kind == "ok":
		return "ok"
	case r.Status == 503:
		return "refused"
	}
	return "failed"
}

// Plot draws the run as a timeline into a PNG at path: every request's time to first
// token (small) and total latency (large) by when it started, coloured by outcome, fault
// windows shaded and labelled; below, each node's ring size over time.
func (r *Report) Plot(path string) error {
	secs := func(t time.Time) float64 { return t.Sub(r.Started).Seconds() }
	top := plot.New()
	top.Title.Text = fmt.Sprintf("%s: %d requests, %d resumed, %d failed", r.Scenario, r.Sent, r.Resumed, r.Failed)
	top.X.Label.Text = "seconds since the cluster started"
	top.Y.Label.Text = "latency (s): total ●, first token ·"
	maxY := 0.1
	for _, rec := range r.Records {
		maxY = max(maxY, rec.End.Sub(rec.Start).Seconds())
	}
	// Fault windows first, so points draw over them.
	for i, w := range r.Windows {
		box, err := plotter.NewPolygon(plotter.XYs{{X: secs(w.From), Y: 0}, {X: secs(w.To), Y: 0},
			{X: secs(w.To), Y: maxY * 1.1}, {X: secs(w.From), Y: maxY * 1.1}})
		if err != nil {
			return err
		}
		box.Color = color.NRGBA{R: 0xd6, G: 0x27, B: 0x28, A: 0x30}
		box.LineStyle.Width = 0
		top.Add(box)
		labels, err := plotter.NewLabels(plotter.XYLabels{XYs: plotter.XYs{{X: secs(w.From), Y: maxY * (1.08 - 0.05*float64(i%3))}},
			Labels: []string{w.Kind + " " + w.Node}})
		if err != nil {
			return err
		}
		top.Add(labels)
	}
	for _, kind := range []string{"ok", "resumed", "refused", "failed"} {
		var total, first plotter.XYs
		for _, rec := range r.Records {
			if outcome(rec) != kind {
				continue
			}
			total = append(total, plotter.XY{X: secs(rec.Start), Y: rec.End.Sub(rec.Start).Seconds()})
			if rec.TTFT > 0 {
				first = append(first, plotter.XY{X: secs(rec.Start), Y: rec.TTFT.Seconds()})
			}
		}
		for i, pts := range []plotter.XYs{total, first} {
			if len(pts) == 0 {
				continue
			}
			s, err := plotter.NewScatter(pts)
			if err != nil {
				return err
			}
			s.GlyphStyle.Color = outcomeColors[kind]
			s.GlyphStyle.Shape = draw.CircleGlyph{}
			s.GlyphStyle.Radius = vg.Points(2.5 - 1.5*float64(i))
			top.Add(s)
			if i == 0 {
				top.Legend.Add(kind, s)
			}
		}
	}
	top.Legend.Top = true

	bottom := plot.New()
	bottom.X.Label.Text = "seconds since the cluster started"
	bottom.Y.Label.Text = "ring size"
	// Each node's samples, split where it was not running (no samples for a while), and
	// offset a little so equal sizes stay visible.
	segments := map[string][]plotter.XYs{}
	last := map[string]time.Time{}
	var nodes []string
	for _, s := range r.Rings {
		if _, ok := segments[s.Node]; !ok {
			nodes = append(nodes, s.Node)
		}
		if segs := segments[s.Node]; len(segs) == 0 || s.Time.Sub(last[s.Node]) > time.Second {
			segments[s.Node] = append(segs, nil)
		}
		segs := segments[s.Node]
		segs[len(segs)-1] = append(segs[len(segs)-1], plotter.XY{X: secs(s.Time), Y: float64(s.Size) + 0.04*float64(slices.Index(nodes, s.Node))})
		last[s.Node] = s.Time
	}
	for i, n := range nodes {
		for j, seg := range segments[n] {
			l, err := plotter.NewLine(seg)
			if err != nil {
				return err
			}
			l.Color, l.Width = plotutilColor(i), vg.Points(1.5)
			bottom.Add(l)
			if j == 0 {
				bottom.Legend.Add(n, l)
			}
		}
	}
	bottom.Legend.Top, bottom.Legend.Left = true, true
	if len(nodes) > 0 {
		bottom.Y.Min = 0
	}
	bottom.X.Min, bottom.X.Max = top.X.Min, top.X.Max

	img := vgimg.New(12*vg.Inch, 8*vg.Inch)
	dc := draw.New(img)
	tiles := draw.Tiles{Rows: 2, Cols: 1, PadTop: vg.Points(4), PadBottom: vg.Points(4), PadX: vg.Points(4), PadY: vg.Points(8)}
	canvases := plot.Align([][]*plot.Plot{{top}, {bottom}}, tiles, dc)
	top.Draw(canvases[0][0])
	bottom.Draw(canvases[1][0])
	return savePNG(img, path)
}

// plotutilColor is a distinct colour for series i.
func plotutilColor(i int) color.RGBA {
	palette := []color.RGBA{{R: 0x1f, G: 0x77, B: 0xb4, A: 0xff}, {R: 0xff, G: 0x7f, B: 0x0e, A: 0xff},
		{R: 0x2c, G: 0xa0, B: 0x2c, A: 0xff}, {R: 0xd6, G: 0x27, B: 0x28, A: 0xff}, {R: 0x94, G: 0x67, B: 0xbd, A: 0xff},
		{R: 0x8c, G: 0x56, B: 0x4b, A: 0xff}, {R: 0xe3, G: 0x77, B: 0xc2, A: 0xff}}
	return palette[i%len(palette)]
}

// savePNG writes img to path as a PNG.
func savePNG(img *vgimg.Canvas, path string) error {
	w, err := os.Create(path)
	if err != nil {
		return err
	}
	defer w.Close()
	if _, err := (vgimg.PngCanvas{Canvas: img}).WriteTo(w); err != nil {
		return fmt.Errorf("plot %s: %w", path, err)
	}
	return w.Close()
}

package testbed

import (
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/infernode/infernode/internal/poll"
	"github.com/infernode/infernode/netem"
)

// BenchmarkBreakEven: transfer or recompute, predicted against measured, for prompts of
// 100, 1,000 and 8,000 tokens on links held to 20, 100 and 1,000 Mbit/s. Two nodes, each
// in a network namespace whose link tbf caps, on a fresh cluster for each cell: the
// first conversation's prompt is prefilled cold where it lands (its time to first token:
// the recompute, measured); then conversations that begin with the same prompt enter
// until one lands on the other node, which pulls the beginning from the first (prefix
// digests; the first pull between two nodes is always sent, the costs being unknown: the
// transfer, measured, from the pulling node's counters). Predicted with what a node
// knows: the frame at the link's rate plus two round trips against the prompt at the
// prefill rate the first node gossips; a node transfers when the transfer is 1.25 times
// sooner (kvmove's margin). A pull gives up after twice the prefill it saves, at least
// 10 s (kvmove's Fetch). Root only (namespaces). The model is INFERNODE_BENCH_MODEL (make
// bench-break-even).
func BenchmarkBreakEven(b *testing.B) {
	if err := netem.Available(); err != nil {
		b.Skipf("needs network namespaces (root): %v", err)
	}
	model := benchModel(b)
	vocab := strings.Fields("river stone bridge garden quiet morning light forest path old village market bread window candle winter harbor ship sail wind")
	for _, tokens := range []int{100, 1000, 8000} {
		var sb strings.Builder
		for w := range tokens / 2 { // about 2 tokens a word on the realistic-shape model's vocabulary
			sb.WriteString(vocab[(w*7+w*w)%len(vocab)] + " ")
		}
		system := sb.String()
		for _, mbit := range []int{20, 100, 1000} {
			b.Run(fmt.Sprintf("tokens=%d/cap=%dMbit", tokens, mbit), func(b *testing.B) {
				var prompt, prefill, transfer, frame, rate float64
				var pulledTTFT time.Duration
				for b.Loop() {
					prompt, prefill, transfer, frame, rate, pulledTTFT = breakEvenCell(b, model, system, mbit)
				}
				wire := frame * 8 / (float64(mbit) * 1e6)
				predTransfer, predPrefill := wire, prompt/rate
				b.ReportMetric(prompt, "prompt-tokens")
				b.ReportMetric(frame/1e6, "frame-MB")
				b.ReportMetric(prefill*1000, "prefill-ms")
				b.ReportMetric(predPrefill*1000, "predicted-prefill-ms")
				b.ReportMetric(predTransfer*1000, "predicted-transfer-ms")
				b.ReportMetric(float64(pulledTTFT.Milliseconds()), "pulled-ttft-ms")
				if transfer > 0 {
					b.ReportMetric(transfer*1000, "transfer-ms")
					// The bandwidth at which the measured transfer would take as long as the
					// measured prefill: its fixed part (what is not the wire) kept.
					if fixed := transfer - wire; prefill > fixed {
						b.ReportMetric(frame*8/(prefill-fixed)/1e6, "break-even-Mbit/s")
					}
				}
				b.ReportMetric(frame/prompt*rate*8*1.25/1e6, "predicted-break-even-Mbit/s")
				decide := func(t, p float64) float64 {
					if t > 0 && t < p {
						return 1
					}
					return 0
				}
				b.ReportMetric(decide(predTransfer*1.25, predPrefill), "predicted-transfer")
				b.ReportMetric(decide(transfer, prefill), "measured-transfer")
				b.ReportMetric(0, "ns/op")
			})
		}
	}
}

// breakEvenCell runs one cell of BenchmarkBreakEven on a fresh capped cluster: the prompt's
// tokens, its cold prefill (s), the pull of its KV (s, 0 if none finished), the frame's
// bytes, the prefill rate the first node gossips, and the pulling turn's first token.
func breakEvenCell(b *testing.B, model, system string, mbit int) (prompt, prefill, transfer, frame, rate float64, pulledTTFT time.Duration) {
	topo, err := netem.New("inbe", 2)
	if err != nil {
		b.Fatal(err)
	}
	defer topo.Close()
	c, err := Start(b.Context(), Config{Binary: binary, Model: model, Nodes: 2, LogDir: b.TempDir(), Topology: topo,
		Args: []string{"--threads", "1", "--replicas", "0", "--ctx", "20000", "--sequences", "2", "--log-level", "info"}})
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	for _, h := range topo.Nodes {
		if err := h.Bandwidth(mbit * 1000); err != nil {
			b.Fatal(err)
		}
	}
	if _, err := c.WaitRings(b.Context(), c.IDs(), 30*time.Second); err != nil {
		b.Fatal(err)
	}
	conv := func(i int) []message { return []message{{"system", system}, {"user", fmt.Sprintf("question %d", i)}} }
	r := request(b.Context(), patient, c.Nodes[0], conv(0), 1, true, 5*time.Minute, nil, "")
	if r.Kind != "ok" {
		b.Fatalf("first conversation: %s: %s", r.Kind, r.Error)
	}
	prefill = r.TTFT.Seconds()
	holder := c.Node(r.Served)
	prompt, _ = c.Metric(holder, "infernode_prompt_tokens_total")
	rate, _ = c.Metric(holder, "infernode_prefill_tokens_per_second")
	other := c.Nodes[0]
	if other == holder {
		other = c.Nodes[1]
	}
	// The digest the other node has must show the whole prompt, not one gossiped while it
	// was being prefilled: as full as the prompt's blocks make it (3 bits a block of 4,096,
	// less collisions), give or take.
	want := 0.95 * (1 - math.Exp(-3*math.Floor((prompt-1)/32)/4096))
	if !poll.Within(30*time.Second, 100*time.Millisecond, func() bool {
		v, err := c.View(other)
		return err == nil && slices.ContainsFunc(v.Members, func(m MemberView) bool { return m.ID == holder.ID && m.PrefixDigest >= want })
	}) {
		b.Fatalf("%s never had %s's digest of the whole prompt (fill %.3f)", other.ID, holder.ID, want)
	}
	for i := 1; i < 20; i++ {
		r := request(b.Context(), patient, other, conv(i), 1, true, 5*time.Minute, nil, "")
		if r.Kind != "ok" {
			b.Fatalf("conversation %d: %s: %s", i, r.Kind, r.Error)
		}
		if r.Served == other.ID {
			pulledTTFT = r.TTFT
			break
		}
	}
	if pulledTTFT == 0 {
		b.Fatal("no conversation landed on the other node")
	}
	frame, _ = c.Metric(other, `infernode_kv_transfer_bytes_total{direction="pulled"}`)
	transfer, _ = c.Metric(other, `infernode_kv_transfer_seconds_total{direction="pulled"}`)
	if frame == 0 { // not pulled (the pull gave up): the frame as the prompt's KV would be
		frame = prompt * kvBytesPerToken
	}
	return prompt, prefill, transfer, frame, rate, pulledTTFT
}

// kvBytesPerToken is the realistic-shape model's KV a token (f16, 30 layers, 3 KV heads
// of 64: docs/BENCHMARKS.md), for a cell whose pull gave up before its frame was counted.
const kvBytesPerToken = 23058

package testbed

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/zeebo/blake3"

	"github.com/infernode/infernode/internal/measure"
	"github.com/infernode/infernode/internal/poll"
	"github.com/infernode/infernode/internal/testenv"
	"github.com/infernode/infernode/netem"
)

// BenchmarkHopRealEngine compares requests sent to their owner with the same requests
// entering on another node, on real infernode processes and the default model. Each
// request generates one token, so its latency is its time to first token; every
// conversation is new (no cached prefix) and short.
func BenchmarkHopRealEngine(b *testing.B) {
	c := startCluster(b, 2)
	owner, entry := c.Nodes[1], c.Nodes[0]
	var convs [][]message
	for i := 0; len(convs) < 200; i++ {
		m := []message{{"user", fmt.Sprintf("question %d about the river", i)}}
		if chat(b, entry.URL(), m, 1).node == owner.ID {
			convs = append(convs, m)
		}
	}
	for _, tc := range []struct {
		name string
		via  *Node
	}{{"direct", owner}, {"forwarded", entry}} {
		b.Run(tc.name, func(b *testing.B) {
			var lat []time.Duration
			i := 0
			for b.Loop() {
				start := time.Now()
				if a := chat(b, tc.via.URL(), convs[i%len(convs)], 1); a.node != owner.ID {
					b.Fatalf("served by %s", a.node)
				}
				lat = append(lat, time.Since(start))
				i++
			}
			slices.Sort(lat)
			b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1000, "p50-ms")
			b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds())/1000, "p99-ms")
		})
	}
}

// BenchmarkMovedTurn: the time to first token of the next turn of a long conversation
// whose owner left (SIGTERM: its caches are handed off) or died (kill -9: its replicas
// take over), against the same turn of an identical conversation its new owner has never
// seen (cold prefill). Each iteration starts a 3-node cluster. The model is
// INFERNODE_BENCH_MODEL when set (make bench-model), else the test model.
func BenchmarkMovedTurn(b *testing.B) {
	var extra []string
	if m := os.Getenv("INFERNODE_BENCH_MODEL"); m != "" {
		extra = append(extra, "--model", m)
	}
	for _, how := range []string{"leave", "kill"} {
		b.Run(how, func(b *testing.B) {
			var warm, cold []time.Duration
			cached := 0
			for b.Loop() {
				c := startCluster(b, 3, extra...)
				entry, victim := c.Nodes[0], c.Nodes[1]
				var m []message
				for i := 0; m == nil; i++ {
					try := []message{{"system", fmt.Sprintf("story %d: %s", i, strings.Repeat("a long and winding tale of the river and the sea ", 90))}, {"user", "begin"}}
					if chat(b, entry.URL(), try, 1).node == victim.ID {
						m = try
					}
				}
				first := chat(b, entry.URL(), m, 32)
				next := append(m, message{"assistant", first.text}, message{"user", "go on"})
				control := slices.Clone(next)
				control[0].Content = "another " + control[0].Content // the same length, never seen
				settledTransfers(b, c, c.Nodes[0], c.Nodes[2])
				if how == "leave" {
					victim.Stop(30 * time.Second)
				} else {
					victim.Kill()
				}
				if _, err := c.WaitRings(b.Context(), c.IDs(entry, c.Nodes[2]), 10*time.Second, victim); err != nil {
					b.Fatal(err)
				}
				start := time.Now()
				a := chat(b, entry.URL(), next, 1)
				warm = append(warm, time.Since(start))
				cached += a.cached
				start = time.Now()
				chat(b, entry.URL(), control, 1)
				cold = append(cold, time.Since(start))
				c.Close()
			}
			slices.Sort(warm)
			slices.Sort(cold)
			b.ReportMetric(float64(warm[len(warm)/2].Microseconds())/1000, "moved-ttft-ms")
			b.ReportMetric(float64(cold[len(cold)/2].Microseconds())/1000, "cold-ttft-ms")
			b.ReportMetric(float64(cold[len(cold)/2])/float64(warm[len(warm)/2]), "speedup")
			b.ReportMetric(float64(cached)/float64(len(warm)), "cached-tokens")
		})
	}
}

// BenchmarkTransferOrRecompute: on namespaced nodes whose links tbf caps at 10, 100 and
// 1,000 Mbit/s (and --kv-bandwidth says the same), two nodes serve conversations of about
// 650 tokens, a third joins, and the old owners decide for each conversation it now owns:
// push its KV, or leave it to be recomputed there. Reported: the share moved by
// transfer, the transfer rate achieved, the prefill rate the nodes measured, the KV bytes
// a token, the break-even bandwidth these give, and the moved conversations' next time to
// first token on the new node. The model is INFERNODE_BENCH_MODEL when set.
func BenchmarkTransferOrRecompute(b *testing.B) {
	if err := netem.Available(); err != nil {
		b.Skipf("needs network namespaces (root): %v", err)
	}
	model := benchModel(b)
	for _, mbit := range []int{10, 100, 1000} {
		b.Run(fmt.Sprintf("cap=%dMbit", mbit), func(b *testing.B) {
			var transferred, recomputed, bytes, seconds, prefill, cached float64
			var ttft, cold []time.Duration
			for b.Loop() {
				topo, err := netem.New("inkv", 3)
				if err != nil {
					b.Fatal(err)
				}
				c, err := Start(b.Context(), Config{Binary: binary, Model: model, Nodes: 2, LogDir: b.TempDir(), Topology: topo,
					Args: []string{"--threads", "1", "--log-level", "info", "--kv-bandwidth", fmt.Sprint(mbit)}})
				if err != nil {
					topo.Close()
					b.Fatal(err)
				}
				for _, h := range topo.Nodes {
					if err := h.Bandwidth(mbit * 1000); err != nil {
						b.Fatal(err)
					}
				}
				if _, err := c.WaitRings(b.Context(), c.IDs(), 30*time.Second); err != nil {
					b.Fatal(err)
				}
				var convs [][]message
				for i := range 9 {
					m := []message{{"system", fmt.Sprintf("story %d: %s", i, strings.Repeat("a long and winding tale of the river and the sea ", 40))}, {"user", "begin"}}
					first := chat(b, c.Nodes[i%2].URL(), m, 16)
					convs = append(convs, append(m, message{"assistant", first.text}, message{"user", "go on"}))
				}
				sent := func(what string) float64 {
					sum := 0.0
					for _, n := range c.Nodes[:2] {
						v, _ := c.Metric(n, what)
						sum += v
					}
					return sum
				}
				before := []float64{sent(`infernode_kv_transfers_total{direction="sent",outcome="ok"}`),
					sent(`infernode_kv_transfers_total{direction="sent",outcome="recompute"}`),
					sent(`infernode_kv_transfer_bytes_total{direction="sent"}`), sent(`infernode_kv_transfer_seconds_total{direction="sent"}`)}
				joined, err := c.Add(b.Context(), "node3")
				if err != nil {
					b.Fatal(err)
				}
				if _, err := c.WaitRings(b.Context(), c.IDs(), 30*time.Second); err != nil {
					b.Fatal(err)
				}
				settledTransfers(b, c, joined)
				transferred += sent(`infernode_kv_transfers_total{direction="sent",outcome="ok"}`) - before[0]
				recomputed += sent(`infernode_kv_transfers_total{direction="sent",outcome="recompute"}`) - before[1]
				bytes += sent(`infernode_kv_transfer_bytes_total{direction="sent"}`) - before[2]
				seconds += sent(`infernode_kv_transfer_seconds_total{direction="sent"}`) - before[3]
				p, _ := c.Metric(c.Nodes[0], "infernode_prefill_tokens_per_second")
				prefill = max(prefill, p)
				// Streamed, for the time to the first token alone.
				first := func(m []message) Record {
					r := request(b.Context(), client, c.Nodes[0], m, 1, true, time.Minute, nil, "")
					if r.Kind != "ok" {
						b.Fatalf("%s: %s", r.Kind, r.Error)
					}
					return r
				}
				for _, m := range convs {
					if a := first(m); a.Served == joined.ID {
						ttft = append(ttft, a.TTFT)
						cached += float64(a.Cached)
						// The same turn of a conversation nobody has seen, as long.
						control := slices.Clone(m)
						control[0].Content = "another " + control[0].Content
						cold = append(cold, first(control).TTFT)
					}
				}
				c.Close()
				topo.Close()
			}
			if len(ttft) > 0 {
				slices.Sort(ttft)
				slices.Sort(cold)
				b.ReportMetric(float64(ttft[len(ttft)/2].Milliseconds()), "moved-ttft-ms")
				b.ReportMetric(float64(cold[len(cold)/2].Milliseconds()), "cold-ttft-ms")
				b.ReportMetric(cached/float64(len(ttft)), "moved-cached-tokens")
			}
			b.ReportMetric(transferred, "transferred")
			b.ReportMetric(recomputed, "recomputed")
			if seconds > 0 {
				b.ReportMetric(bytes/seconds*8/1e6, "transfer-Mbit/s")
				perToken := bytes / transferred / (cached / float64(len(ttft)))
				b.ReportMetric(perToken, "KV-bytes/token")
				b.ReportMetric(perToken*prefill*8/1e6*1.25, "break-even-Mbit/s")
			}
			b.ReportMetric(prefill, "prefill-tok/s")
		})
	}
}

// BenchmarkTenantPrefix proves by time what TestTenantsIsolated proves by a counter: a
// tenant sending another tenant's long system prompt gets no faster first token than a
// cold prefill, while the first tenant's own next conversation starts from the shared
// prefix. Each iteration uses a system prompt of about 1,000 tokens never sent before:
// alpha's first conversation (cold), beta's with the same system prompt (another tenant),
// then alpha's second (its own tenant: shared). One node, INFERNODE_BENCH_MODEL when set.
func BenchmarkTenantPrefix(b *testing.B) {
	model := benchModel(b)
	keys := filepath.Join(b.TempDir(), "keys")
	if err := os.WriteFile(keys, []byte("key-of-alpha-000001 alpha\nkey-of-beta-0000002 beta\n"), 0o600); err != nil {
		b.Fatal(err)
	}
	c := launch(b, Config{Model: model, Nodes: 1, APIKey: "default-key-0123456789", Args: []string{"--ctx", "8192", "--threads", "2", "--key-file", keys}})
	if _, err := c.WaitRings(b.Context(), c.IDs(), 60*time.Second); err != nil {
		b.Fatal(err)
	}
	url := c.Nodes[0].URL()
	ttft := func(key, system, question string) time.Duration {
		body, _ := json.Marshal(map[string]any{"max_tokens": 1, "temperature": 0,
			"messages": []message{{Role: "system", Content: system}, {Role: "user", Content: question}}})
		start := time.Now()
		if status := postChat(b, url, key, string(body)); status != 200 {
			b.Fatalf("status %d", status)
		}
		return time.Since(start)
	}
	var cold, other, own []time.Duration
	i := 0
	for b.Loop() {
		system := fmt.Sprintf("prompt %d: %s", i, strings.Repeat("you answer questions about rivers and the sea and the boats on them. ", 80))
		i++
		cold = append(cold, ttft("key-of-alpha-000001", system, "where does the river go"))
		other = append(other, ttft("key-of-beta-0000002", system, "what is a boat"))
		own = append(own, ttft("key-of-alpha-000001", system, "how deep is the sea"))
	}
	median := func(d []time.Duration) float64 {
		slices.Sort(d)
		return float64(d[len(d)/2].Microseconds()) / 1000
	}
	b.ReportMetric(median(cold), "cold-ms")
	b.ReportMetric(median(other), "other-tenant-ms")
	b.ReportMetric(median(own), "same-tenant-ms")
	b.ReportMetric(median(other)/median(cold), "other/cold")
	b.ReportMetric(median(own)/median(cold), "same/cold")
}

// BenchmarkKVPush: how fast a conversation's KV moves from one node to another. A
// conversation of about 1,000 prompt tokens goes to one node of two; each iteration sends
// its next turn (a few tokens more, one token answered), after which the node pushes the
// whole conversation's KV to the other as its replica. The rate is the bytes over the
// pushes' wall time (from the sender's hash of the frame to the peer's answer, the peer's
// check and import included), from the nodes' counters; the first push, into memory
// neither process has touched yet, is reported apart (cold-push-ms), and so are the
// median push and its rate (push-p50-ms, p50-MB/s), which one slow push does not move as
// it moves the mean. On loopback with no
// cap (--kv-bandwidth 0), and in network namespaces with each link held to 1 Gbit/s by
// tbf and --kv-bandwidth 1000 (root only). The model is INFERNODE_BENCH_MODEL when set
// (make bench-model), else the test model.
func BenchmarkKVPush(b *testing.B) {
	model := benchModel(b)
	for _, mbit := range []int{0, 1000} {
		name := "loopback"
		if mbit > 0 {
			name = fmt.Sprintf("cap=%dMbit", mbit)
		}
		b.Run(name, func(b *testing.B) {
			cfg := Config{Binary: binary, Model: model, Nodes: 2, LogDir: b.TempDir(),
				Args: []string{"--threads", "1", "--replicas", "1", "--log-level", "info", "--kv-bandwidth", fmt.Sprint(mbit)}}
			if mbit > 0 {
				if err := netem.Available(); err != nil {
					b.Skipf("needs network namespaces (root): %v", err)
				}
				topo, err := netem.New("inpush", 2)
				if err != nil {
					b.Fatal(err)
				}
				defer topo.Close()
				cfg.Topology = topo
			}
			c, err := Start(b.Context(), cfg)
			if err != nil {
				b.Fatal(err)
			}
			defer c.Close()
			if cfg.Topology != nil {
				for _, h := range cfg.Topology.Nodes {
					if err := h.Bandwidth(mbit * 1000); err != nil {
						b.Fatal(err)
					}
				}
			}
			if _, err := c.WaitRings(b.Context(), c.IDs(), 30*time.Second); err != nil {
				b.Fatal(err)
			}
			const (
				sent    = `infernode_kv_transfers_total{direction="sent",outcome="ok"}`
				bytes   = `infernode_kv_transfer_bytes_total{direction="sent"}`
				seconds = `infernode_kv_transfer_seconds_total{direction="sent"}`
			)
			counters := func(n *Node) [3]float64 {
				var v [3]float64
				for i, what := range []string{sent, bytes, seconds} {
					v[i], _ = c.Metric(n, what)
				}
				return v
			}
			m := []message{{"system", "story: " + strings.Repeat("a long and winding tale of the river and the sea ", 70)}, {"user", "begin"}}
			first := chat(b, c.Nodes[0].URL(), m, 1)
			owner := c.Node(first.node)
			if owner == nil || !poll.Within(10*time.Second, 20*time.Millisecond, func() bool { return counters(owner)[0] == 1 }) {
				b.Fatalf("the first turn, served by %q, pushed no replica", first.node)
			}
			cold := counters(owner)
			pushed, last := cold[0], cold
			var each, eachTook []float64 // each push's bytes a second, and seconds
			m = append(m, message{"assistant", first.text})
			for b.Loop() {
				m = append(m, message{"user", "go on"})
				a := chat(b, owner.URL(), m, 1)
				if a.status != 200 || a.node != owner.ID || a.cached == 0 {
					b.Fatalf("turn %d: status %d on %q, %d tokens cached", len(m)/2, a.status, a.node, a.cached)
				}
				m = append(m, message{"assistant", a.text})
				// The replica goes after the answer's end: wait for it, so that the next
				// turn neither overlaps the push nor supersedes it. Every 50 ms, one counter:
				// a scrape is compressed on the sender's cores, and three every 5 ms slowed
				// the push they waited for (push-p50-ms 47 and 67 against 42 and 49).
				pushed++
				if !poll.Within(10*time.Second, 50*time.Millisecond, func() bool { v, _ := c.Metric(owner, sent); return v >= pushed }) {
					b.Fatalf("turn %d pushed no replica", len(m)/2)
				}
				now := counters(owner)
				each = append(each, (now[1]-last[1])/(now[2]-last[2]))
				eachTook = append(eachTook, now[2]-last[2])
				last = now
			}
			end := counters(owner)
			pushes, size, took := end[0]-cold[0], end[1]-cold[1], end[2]-cold[2]
			if pushes == 0 {
				b.Fatal("no KV was pushed")
			}
			frame := size / pushes
			// The floor, measured here in the same run: the sender hashes the frame for its
			// signature, the wire carries it, the receiver hashes it again to check the
			// signature and imports it (the receiver's counter: the import alone).
			var imported float64
			for _, n := range c.Nodes {
				if n != owner {
					imported, _ = c.Metric(n, `infernode_kv_transfer_seconds_total{direction="received"}`)
				}
			}
			hash := measure.HashTime(int(frame), func(b []byte) { blake3.Sum256(b) }) // the hop's hash since 1.9
			wire := time.Duration(frame * 8 / float64(mbit) / 1e6 * float64(time.Second))
			if mbit == 0 {
				if wire, err = measure.LoopbackTime(int(frame)); err != nil {
					b.Fatal(err)
				}
			}
			floor := 2*hash + wire + time.Duration(imported/(pushes+1)*float64(time.Second))
			b.ReportMetric(cold[2]*1000, "cold-push-ms")
			b.ReportMetric(frame/1e6, "frame-MB")
			b.ReportMetric(took/pushes*1000, "push-ms")
			slices.Sort(each)
			slices.Sort(eachTook)
			b.ReportMetric(eachTook[len(eachTook)/2]*1000, "push-p50-ms")
			b.ReportMetric(each[len(each)/2]/1e6, "p50-MB/s")
			b.ReportMetric(float64(floor.Microseconds())/1000, "floor-ms")
			b.ReportMetric(float64(hash.Microseconds())/1000, "blake3-ms")
			b.ReportMetric(float64(wire.Microseconds())/1000, "wire-ms")
			b.ReportMetric(imported/(pushes+1)*1000, "import-ms")
			b.ReportMetric(size/took/1e6, "MB/s")
			b.ReportMetric(size/took*8/1e6, "Mbit/s")
			if mbit > 0 {
				b.ReportMetric(size/took*8/1e6/float64(mbit), "link-share")
			}
			b.ReportMetric(pushes, "pushes")
		})
	}
}

// benchModel is INFERNODE_BENCH_MODEL when set (make bench-model), else the test model.
func benchModel(b *testing.B) string {
	if m := os.Getenv("INFERNODE_BENCH_MODEL"); m != "" {
		return m
	}
	return testenv.Model(b)
}

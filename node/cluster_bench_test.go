package node

import (
	"bytes"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/infernode/infernode/internal/measure"
	"github.com/infernode/infernode/node/hop"
)

const benchBody = `{"prompt":"hello","max_tokens":1}`

func timedPost(b testing.TB, client *http.Client, url, key string) time.Duration {
	req, _ := http.NewRequest("POST", url+"/v1/completions", strings.NewReader(benchBody))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Session-ID", key)
	start := time.Now()
	resp, err := client.Do(req)
	if err != nil {
		b.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		b.Fatalf("status %d", resp.StatusCode)
	}
	return time.Since(start)
}

func percentile(d []time.Duration, p float64) float64 {
	s := slices.Clone(d)
	slices.Sort(s)
	return float64(s[min(len(s)-1, int(float64(len(s))*p))].Microseconds()) / 1000
}

// BenchmarkHop compares requests sent straight to their owner with the same requests
// entering on another node (one signed forwarding hop), with fake engines.
func BenchmarkHop(b *testing.B) {
	nodes := startFakeCluster(b, 2, testSecret)
	keys := ownedBy(b, nodes[0], "n2", 64)
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 8}}
	for _, tc := range []struct {
		name string
		url  string
	}{{"direct", nodes[1].url}, {"forwarded", nodes[0].url}} {
		b.Run(tc.name, func(b *testing.B) {
			var lat []time.Duration
			i := 0
			for b.Loop() {
				lat = append(lat, timedPost(b, client, tc.url, keys[i%len(keys)]))
				i++
			}
			b.ReportMetric(percentile(lat, 0.5), "p50-ms")
			b.ReportMetric(percentile(lat, 0.99), "p99-ms")
		})
	}
}

// BenchmarkRoutingCapacity measures forwarded requests a second through one entry node,
// with fake engines on the owners.
func BenchmarkRoutingCapacity(b *testing.B) {
	nodes := startFakeCluster(b, 3, testSecret)
	keys := append(ownedBy(b, nodes[0], "n2", 32), ownedBy(b, nodes[0], "n3", 32)...)
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
	b.SetParallelism(8)
	start := time.Now()
	b.RunParallel(func(pb *testing.PB) {
		i := 0
		for pb.Next() {
			timedPost(b, client, nodes[0].url, keys[i%len(keys)])
			i++
		}
	})
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "req/s")
}

// BenchmarkPullAnswer measures a node answering a peer's KV pull on loopback: a 31 MB
// frame from the fake engine's memory, hashed for the answer's signature, through the
// signed pull hop, read whole and its signature checked by the asker (its import left
// out): hashed as it arrives, as kvmove does, or after it has arrived, as before 1.10.
// Its floor, measured in the same run: the two hashes and a loopback copy one after the
// other.
func BenchmarkPullAnswer(b *testing.B) {
	nodes, frame, auth, client, floor := kvBench(b)
	nodes[1].engine.frame = frame
	buf := make([]byte, len(frame))
	for _, arriving := range []bool{true, false} {
		name := "hashed-as-it-arrives"
		if !arriving {
			name = "hashed-after"
		}
		b.Run(name, func(b *testing.B) {
			b.SetBytes(int64(len(frame)))
			start := time.Now()
			for b.Loop() {
				body := []byte("conv-1")
				req, _ := http.NewRequest("POST", nodes[1].url+hop.PullPath, bytes.NewReader(body))
				auth.Sign(req.Header.Set, "POST", hop.PullPath, "n2", body)
				resp, err := client.Do(req)
				if err != nil {
					b.Fatal(err)
				}
				if resp.StatusCode != http.StatusOK {
					b.Fatalf("pull: status %d", resp.StatusCode)
				}
				h := hop.HashFor(resp.Header.Get)
				if arriving {
					err = hop.ReadHashing(resp.Body, buf, h)
				} else if _, err = io.ReadFull(resp.Body, buf); err == nil {
					h.Write(buf)
				}
				if err != nil {
					b.Fatal(err)
				}
				resp.Body.Close()
				if err := auth.VerifyAnswerSum(resp.Header.Get, hop.PullPath, "n2", req.Header.Get(hop.HeaderNonce), hop.SumFrom(h)); err != nil {
					b.Fatal(err)
				}
			}
			reportFloor(b, time.Since(start)/time.Duration(b.N), floor)
		})
	}
}

// BenchmarkPushTaken measures a node taking a 30 MB KV frame a peer pushes on loopback:
// the frame signed over its hash, read, hashed and checked by the node (the fake engine
// then refuses it: its import is left out). Its floor, measured in the same run: the
// sender's hash, a loopback copy and the receiver's hash, one after the other.
func BenchmarkPushTaken(b *testing.B) {
	nodes, frame, auth, client, floor := kvBench(b)
	b.SetBytes(int64(len(frame)))
	start := time.Now()
	for b.Loop() {
		req, _ := http.NewRequest("POST", nodes[1].url+hop.KVPath, bytes.NewReader(frame))
		req.Header.Set("Content-Type", "application/octet-stream")
		auth.SignHash(req.Header.Set, "POST", hop.KVPath, "n2", hop.SumOf(frame, true))
		resp, err := client.Do(req)
		if err != nil {
			b.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusBadRequest { // read and checked, then refused by the fake engine
			b.Fatalf("push: status %d, want 400 from the fake engine", resp.StatusCode)
		}
	}
	reportFloor(b, time.Since(start)/time.Duration(b.N), floor)
}

// kvBench starts the two fake nodes of a KV transfer benchmark and makes its 30 MB frame,
// the peer n1's signer, a client of one connection, and the transfer's floor measured
// here: two BLAKE3 passes over the frame and its loopback copy, one after the other.
func kvBench(b *testing.B) ([]fakeNode, []byte, *hop.Auth, *http.Client, time.Duration) {
	nodes := startFakeCluster(b, 2, testSecret)
	frame := make([]byte, 30<<20)
	for i := range frame {
		frame[i] = byte(i * 7)
	}
	wire, err := measure.LoopbackTime(len(frame))
	if err != nil {
		b.Fatal(err)
	}
	floor := 2*measure.HashTime(len(frame), func(b []byte) { hop.SumOf(b, true) }) + wire
	return nodes, frame, hop.NewAuth("n1", testSecret, nil, time.Now, 30*time.Second),
		&http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1}}, floor
}

// reportFloor reports a transfer's time against its floor.
func reportFloor(b *testing.B, took, floor time.Duration) {
	b.ReportMetric(float64(floor.Microseconds())/1000, "floor-ms")
	b.ReportMetric(float64(took)/float64(floor), "x-floor")
}

package gossip

import "testing"

// TestGoldenMeta: the metadata peers gossip, byte for byte, written down before any move
// of the schema out of this package. Older nodes decode exactly this.
func TestGoldenMeta(t *testing.T) {
	m := Meta{ID: "node1", HTTPAddr: "127.0.0.1:8080", Fingerprint: "fp", Model: "tiny", Ready: true, Running: 1, Waiting: 2,
		FreeKV: 3, QueueCap: 4, Prefill: 5, Decode: 6, Leaving: true, Hop: []int{1}, Slow: []string{"node2"}}
	const want = `{"id":"node1","http":"127.0.0.1:8080","fp":"fp","model":"tiny","ready":true,"run":1,"wait":2,"kvfree":3,"qcap":4,"pf":5,"tps":6,"leaving":true,"hop":[1],"slow":["node2"]}`
	b, err := m.Encode()
	if err != nil || string(b) != want {
		t.Fatalf("metadata:\n got %s (%v)\nwant %s", b, err, want)
	}
	back, err := DecodeMeta([]byte(want))
	if err != nil {
		t.Fatal(err)
	}
	if b, _ := back.Encode(); string(b) != want {
		t.Errorf("decoded and encoded again:\n got %s\nwant %s", b, want)
	}
	const minimal = `{"id":"n","http":"h:1","fp":"","ready":false}`
	if b, _ := (Meta{ID: "n", HTTPAddr: "h:1"}).Encode(); string(b) != minimal {
		t.Errorf("minimal metadata:\n got %s\nwant %s", b, minimal)
	}
}

package routing

import (
	"strings"
	"testing"
)

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
	// Since hop 1.4, the minor version beside the majors (older nodes ignore it).
	const minor = `{"id":"n","http":"h:1","fp":"","ready":false,"hop":[1],"hopv":4}`
	if b, _ := (Meta{ID: "n", HTTPAddr: "h:1", Hop: []int{1}, HopMinor: 4}).Encode(); string(b) != minor {
		t.Errorf("metadata with the hop minor version:\n got %s\nwant %s", b, minor)
	}
	const minimal = `{"id":"n","http":"h:1","fp":"","ready":false}`
	if b, _ := (Meta{ID: "n", HTTPAddr: "h:1"}).Encode(); string(b) != minimal {
		t.Errorf("minimal metadata:\n got %s\nwant %s", b, minimal)
	}
}

// TestMetaSize: typical metadata is far within gossip's limit; too long an id is refused.
func TestMetaSize(t *testing.T) {
	if b, _ := (Meta{ID: "node-with-a-long-name-0001", HTTPAddr: "255.255.255.255:65535", Fingerprint: strings.Repeat("f", 16),
		Ready: true, Running: 256, Waiting: 1024, FreeKV: 1 << 20, QueueCap: 1024}).Encode(); len(b) > 200 {
		t.Errorf("typical metadata is %d bytes", len(b))
	}
	if _, err := (Meta{ID: strings.Repeat("i", 600)}).Encode(); err == nil {
		t.Error("metadata over 512 bytes encoded")
	}
}

func TestMetaValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		meta Meta
		ok   bool
	}{
		{"a#1", Meta{ID: "a", HTTPAddr: "127.0.0.1:8080"}, true},
		{"a#1", Meta{ID: "a", HTTPAddr: "node-a.example:80"}, true},
		{"a#1", Meta{ID: "a", HTTPAddr: "[::1]:8080"}, true},
		{"a#1", Meta{ID: "b", HTTPAddr: "127.0.0.1:8080"}, false}, // claims another id
		{"a", Meta{ID: "a", HTTPAddr: "127.0.0.1:8080"}, false},   // name without incarnation
		{"a#1", Meta{ID: "", HTTPAddr: "127.0.0.1:8080"}, false},
		{"a#1", Meta{ID: "a", HTTPAddr: "10.0.0.5:80/admin?x="}, false},
		{"a#1", Meta{ID: "a", HTTPAddr: "user@10.0.0.5:80"}, false},
		{"a#1", Meta{ID: "a", HTTPAddr: "http://10.0.0.5:80"}, false},
		{"a#1", Meta{ID: "a", HTTPAddr: "10.0.0.5"}, false},
		{"a#1", Meta{ID: "a", HTTPAddr: "10.0.0.5:0"}, false},
		{"a#1", Meta{ID: "a", HTTPAddr: "10.0.0.5:080"}, false},
		{"a#1", Meta{ID: "a", HTTPAddr: ":80"}, false},
	} {
		if err := tc.meta.Validate(tc.name); (err == nil) != tc.ok {
			t.Errorf("Meta{ID: %q, HTTPAddr: %q}.Validate(%q) = %v, want ok %v", tc.meta.ID, tc.meta.HTTPAddr, tc.name, err, tc.ok)
		}
	}
}

// TestSchema: what gossip asks of routing's metadata. A change of load alone is not
// urgent (gossip paces it); readiness, a full queue, slow peers and leaving are; a leave
// is announced in the tags; tags that lie or do not parse are refused.
func TestSchema(t *testing.T) {
	enc := func(m Meta) []byte {
		b, err := m.Encode()
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	base := Meta{ID: "a", HTTPAddr: "h:1", Ready: true, QueueCap: 4, Running: 1}
	loaded, full, unready, slow := base, base, base, base
	loaded.Running, loaded.FreeKV, loaded.Prefill, loaded.Decode = 3, 100, 900, 40
	full.Waiting = 4
	unready.Ready = false
	slow.Slow = []string{"b"}
	for _, tc := range []struct {
		name string
		next Meta
		want bool
	}{{"load", loaded, false}, {"queue full", full, true}, {"not ready", unready, true}, {"a slow peer", slow, true}} {
		if got := Schema.Urgent(enc(base), enc(tc.next)); got != tc.want {
			t.Errorf("%s: urgent %v, want %v", tc.name, got, tc.want)
		}
	}
	if !Schema.Urgent(nil, enc(base)) {
		t.Error("tags never sent are not urgent")
	}
	left := Schema.Leave(enc(base))
	if m, err := DecodeMeta(left); err != nil || !m.Leaving || !Schema.Leaving(left) || Schema.Leaving(enc(base)) || !Schema.Urgent(enc(base), left) {
		t.Errorf("leave: %s (%v)", left, err)
	}
	if err := Schema.Validate("a#1", enc(base)); err != nil {
		t.Errorf("valid tags refused: %v", err)
	}
	for _, bad := range [][]byte{[]byte("{not json"), enc(Meta{ID: "b", HTTPAddr: "h:1"}), enc(Meta{ID: "a", HTTPAddr: "h:1/x"})} {
		if Schema.Validate("a#1", bad) == nil {
			t.Errorf("tags %s accepted", bad)
		}
	}
}

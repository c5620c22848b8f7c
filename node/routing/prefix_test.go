package routing

import (
	"strings"
	"testing"

	dto "github.com/prometheus/client_model/go"

	"github.com/infernode/infernode/node/hop"
	"github.com/infernode/infernode/session/infer"
)

// TestDigest: a beginning counts as held only from its first block on, and a filled
// digest's false positives stay near what its size promises.
func TestDigest(t *testing.T) {
	held := blockHashes(digestBlocks)
	d := newDigest(held[:5])
	if !d.valid() || d.blocks(held) != 5 || d.blocks(held[1:]) != 4 {
		t.Errorf("blocks = %d, %d; want 5 and 4", d.blocks(held), d.blocks(held[1:]))
	}
	if got := newDigest(held[1:5]).blocks(held); got != 0 {
		t.Errorf("a digest without the first block shows %d blocks", got)
	}
	full := newDigest(held)
	false1 := 0
	for i := range 10000 {
		if full.has(uint64(i+1) * 0xbf58476d1ce4e5b9) {
			false1++
		}
	}
	if rate := float64(false1) / 10000; rate > 0.04 {
		t.Errorf("a digest of %d blocks has %.1f%% false positives, want about 2%%", digestBlocks, 100*rate)
	}
	if digest(make([]byte, 10)).valid() || digest(append([]byte{digestFormat + 1}, make([]byte, digestBits/8)...)).valid() {
		t.Error("a note of another layout reads as a digest")
	}
}

// TestPrefixElsewhere: the owner of a new conversation whose beginning a peer's digest
// shows, for more blocks than its own, has that peer (the one showing most) prefill the
// prompt up to one block past what it shows, then serves the turn here; it does not when
// it holds as much itself, or when the peer's note is no digest.
func TestPrefixElsewhere(t *testing.T) {
	c := newCluster(t, "b", "c")
	var ms []member
	for _, id := range []string{"b", "c"} {
		m := peerMember(id)
		m.Meta.HopMinor = hop.Minor // a peer that takes prefill-only requests and signed pulls
		ms = append(ms, m)
	}
	c.members.set(ms...)
	c.entry.v.Sync()
	key := c.keyOwnedBy("a")
	prompt := strings.Repeat("x ", 6*infer.PrefixBlock) // 6 blocks, the last token left out: 5
	hashes := blockHashes(5)
	setNotes := func(b, cc []byte) {
		c.members.mu.Lock()
		c.members.notes = map[string][]byte{"b#1": b, "c#1": cc}
		c.members.mu.Unlock()
	}
	serve := func() {
		t.Helper()
		st, err := c.entry.ServeLocal(t.Context(), greedy(key, prompt, 2))
		if err != nil {
			t.Fatal(err)
		}
		if _, res := collect(st); res.Err != nil {
			t.Fatal(res.Err)
		}
	}
	pulls := func(outcome string) float64 {
		var m dto.Metric
		c.entry.prefixes.WithLabelValues(outcome).Write(&m)
		return m.GetCounter().GetValue()
	}

	setNotes(newDigest(hashes[:3]), newDigest(hashes[:2]))
	serve()
	got := c.peers["b"].engine.last.Load()
	if got == nil || !got.PrefillOnly || len(got.Tokens) != 4*infer.PrefixBlock || got.SessionID != key {
		t.Fatalf("b was asked %+v; want a prefill-only request of %d tokens for %s", got, 4*infer.PrefixBlock, key)
	}
	if c.peers["c"].engine.last.Load() != nil {
		t.Error("c, whose digest shows less, was asked")
	}
	// The fake engine gives no KV: the pull fails, and the turn was prefilled here.
	if pulls("failed") != 1 || c.local.served.Load() != 1 {
		t.Errorf("failed pulls %v, served here %d; want 1 and 1", pulls("failed"), c.local.served.Load())
	}

	for _, tc := range []struct {
		name string
		here digest
		b    []byte
	}{
		{"held here as long", newDigest(hashes[:3]), newDigest(hashes[:3])},
		{"shown for one block only", nil, newDigest(hashes[:1])},
		{"a note that is no digest", nil, []byte("garbage")},
	} {
		c.peers["b"].engine.last.Store(nil)
		if tc.here != nil {
			c.entry.held.Store(&tc.here)
		}
		setNotes(tc.b, nil)
		serve()
		if got := c.peers["b"].engine.last.Load(); got != nil {
			t.Errorf("%s: b was asked %+v", tc.name, got)
		}
		c.entry.held.Store(nil)
	}
}

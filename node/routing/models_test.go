package routing

import (
	"errors"
	"fmt"
	"slices"
	"testing"

	"github.com/infernode/infernode/node/hop"
	"github.com/infernode/infernode/session/infer"
)

// otherModel moves peers ids of c to model m2 (fingerprint fp2) and lets the entry see it.
func (c *cluster) otherModel(ids ...string) {
	ms := c.members.list()
	for i := range ms {
		if slices.Contains(ids, ms[i].Meta.ID) {
			ms[i].Meta.Fingerprint, ms[i].Meta.Model = "fp2", "m2"
		}
	}
	c.members.set(ms...)
	c.entry.v.Sync()
}

// keyOn finds a conversation key whose first owner on ring is id.
func (c *cluster) keyOn(ring, id string) string {
	for i := range 100000 {
		k := fmt.Sprint("conv-", i)
		if cands := c.entry.v.candidates(ring, k); len(cands) > 0 && cands[0].id == id {
			return k
		}
	}
	c.t.Fatalf("no key owned by %s on ring %q", id, ring)
	return ""
}

func TestOtherModels(t *testing.T) {
	c := newCluster(t, "b", "c", "d")
	c.otherModel("b", "c")

	if got := c.entry.v.table.Ring().Members(); !slices.Equal(got, []string{"a", "d"}) {
		t.Fatalf("own ring = %v, want [a d]", got)
	}
	if got := c.entry.v.table.RingOf("fp2").Members(); !slices.Equal(got, []string{"b", "c"}) {
		t.Fatalf("ring of m2 = %v, want [b c]", got)
	}
	want := []ModelInfo{{ID: "m", Nodes: 2, Ready: 2, Local: true}, {ID: "m2", Nodes: 2, Ready: 2}}
	if got := c.entry.Models(); !slices.Equal(got, want) {
		t.Fatalf("Models() = %+v, want %+v", got, want)
	}
	var e *hop.Error
	if _, err := c.entry.SubmitModel(t.Context(), "nope", greedy("k", "x", 4)); !errors.As(err, &e) || e.Code != "model_not_found" {
		t.Fatalf("a model nobody serves: err = %v, want model_not_found", err)
	}

	// A chat for m2 goes to its owner on m2's ring as messages; the owner formats them.
	// When the owner dies mid-answer, the next owner continues the prompt the first one
	// formatted: the answer is the uninterrupted one.
	key := c.keyOn("fp2", "b")
	c.peers["b"].engine.set(script{crashAfter: 3})
	req := infer.Request{SessionID: key, Messages: []infer.Message{{Role: "user", Content: "hi"}}, MaxTokens: 8, Sampling: infer.Greedy()}
	st, err := c.entry.SubmitModel(t.Context(), "m2", req)
	if err != nil {
		t.Fatal(err)
	}
	text, res := collect(st)
	if res.Err != nil || text != " w0 w1 w2 w3 w4 w5 w6 w7" {
		t.Fatalf("answer %q, err %v; want the 8 words uninterrupted", text, res.Err)
	}
	if r := resumes(st); r != 1 {
		t.Fatalf("resumes = %d, want 1", r)
	}
	// The text the dead owner generated goes to the next one marked as data (see
	// infer.ContentMark): text that spells a control token never becomes one.
	mark := infer.ContentMark
	for id, want := range map[string]string{"b": "m2: user: hi\n", "c": "m2: user: hi\n" + mark + " w0 w1 w2" + mark} {
		p := c.peers[id]
		p.mu.Lock()
		hops := slices.Clone(p.hops)
		p.mu.Unlock()
		if len(hops) != 1 || hops[0] != want {
			t.Fatalf("%s took hops %q, want [%q]", id, hops, want)
		}
	}
	if n := c.local.served.Load() + c.peers["d"].engine.served.Load(); n != 0 {
		t.Fatalf("nodes of another model served %d requests for m2", n)
	}

	// When every node of m2 is busy, the client is told so: this node cannot serve m2.
	c.peers["b"].engine.set(script{busy: true})
	c.peers["c"].engine.set(script{busy: true})
	var remote *hop.Error
	if _, err := c.entry.SubmitModel(t.Context(), "m2", greedy(key, "x", 4)); !errors.As(err, &remote) || remote.Status != 503 {
		t.Fatalf("every node of m2 busy: err = %v, want a 503", err)
	}
	// And when none is on the ring, the same, without trying anyone.
	for _, id := range []string{"b", "c"} {
		for range c.entry.cfg.Ring.DownAfter {
			c.entry.v.observe(id, false, "test")
		}
	}
	if c.entry.v.table.RingOf("fp2").Len() != 0 {
		t.Fatalf("ring of m2 = %v after its nodes failed, want empty", c.entry.v.table.RingOf("fp2").Members())
	}
	if _, err := c.entry.SubmitModel(t.Context(), "m2", greedy(key, "x", 4)); !errors.As(err, &remote) || remote.Code != "model_unavailable" {
		t.Fatalf("no node of m2 healthy: err = %v, want model_unavailable", err)
	}
	if n := c.local.served.Load(); n != 0 {
		t.Fatalf("the entry served %d requests for a model it does not have", n)
	}
}

// TestOwnerMustKnowTheRequest: a request with a sharing domain (hop 1.4) never goes to an
// owner that gossips an older minor version (it would ignore the domain and share cells
// across tenants): the next capable owner serves it, else this node. Requests without one
// go to any owner.
func TestOwnerMustKnowTheRequest(t *testing.T) {
	c := newCluster(t, "b", "c")
	ms := c.members.list()
	for i := range ms {
		if ms[i].Meta.ID == "c" {
			ms[i].Meta.HopMinor = hop.Minor
		}
	}
	c.members.set(ms...)
	c.entry.v.Sync()
	for _, tc := range []struct {
		owners []string
		share  string
		want   string
	}{
		{[]string{"b", "c"}, "", "b"},
		{[]string{"b", "c"}, "t:x", "c"},
		{[]string{"c"}, "t:x", "c"},
	} {
		req := greedy(c.keyOwnedBy(tc.owners...), "hello", 2)
		req.Share = tc.share
		st, err := c.entry.Submit(t.Context(), req)
		if err != nil {
			t.Fatal(err)
		}
		if _, res := collect(st); res.Err != nil || servedBy(st) != tc.want {
			t.Errorf("owners %v, share %q: served by %s (%v), want %s", tc.owners, tc.share, servedBy(st), res.Err, tc.want)
		}
	}
	// The only other owner is old: this node serves it.
	c = newCluster(t, "b")
	req := greedy(c.keyOwnedBy("b"), "hello", 2)
	req.Share = "t:x"
	st, err := c.entry.Submit(t.Context(), req)
	if err != nil {
		t.Fatal(err)
	}
	if _, res := collect(st); res.Err != nil || servedBy(st) != "a" {
		t.Errorf("only an old owner: served by %s (%v), want a", servedBy(st), res.Err)
	}
}

package session

import (
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/infernode/infernode/session/infer"
)

// Placement needs no model: these table tests build the engine's slots by hand, as
// ollama's cache-slot tests do.

// slots makes idle or running slots: each spec is a key, its cached tokens, whether a
// request runs in it (reserving its tokens plus max tokens), and when it was last used.
type slotSpec struct {
	key     string
	tokens  int
	running int // >0: a running request reserving this many cells
	used    uint64
}

func testEngine(cells int, unified bool, specs ...slotSpec) *Engine {
	e := &Engine{cfg: Config{Cells: cells, UnifiedKV: unified, Sequences: len(specs)}, cells: cells, share: cells}
	for i, sp := range specs {
		s := &slot{seq: i, key: sp.key, tokens: make([]int32, sp.tokens), lastUsed: sp.used}
		for k := range s.tokens {
			s.tokens[k] = int32(k)
		}
		if sp.running > 0 {
			s.job = &job{prompt: make([]int32, sp.running), claim: sp.running}
		}
		e.slots = append(e.slots, s)
	}
	return e
}

func prompt(n int) []int32 {
	p := make([]int32, n)
	for i := range p {
		p[i] = int32(i)
	}
	return p
}

func TestPlace(t *testing.T) {
	for _, tc := range []struct {
		name      string
		cells     int
		unified   bool
		slots     []slotSpec
		key       string
		prompt    int
		maxTokens int
		ok        bool
		slot      int   // the slot chosen
		reuse     int   // cached tokens reused
		evict     []int // slots evicted, in order
	}{
		{name: "own idle slot, prefix reused minus the last token", cells: 1000, unified: true,
			slots: []slotSpec{{key: "x", tokens: 50, used: 1}, {key: "", tokens: 0}}, key: "x", prompt: 60, maxTokens: 10,
			ok: true, slot: 0, reuse: 50},
		{name: "whole prompt cached: the last token is decoded again", cells: 1000, unified: true,
			slots: []slotSpec{{key: "x", tokens: 60, used: 1}}, key: "x", prompt: 60, maxTokens: 10, ok: true, slot: 0, reuse: 59},
		{name: "empty slot before evicting", cells: 1000, unified: true,
			slots: []slotSpec{{key: "a", tokens: 10, used: 1}, {}}, key: "y", prompt: 20, maxTokens: 10, ok: true, slot: 1},
		{name: "least recently used idle slot is taken", cells: 1000, unified: true,
			slots: []slotSpec{{key: "a", tokens: 10, used: 5}, {key: "b", tokens: 10, used: 2}, {key: "c", tokens: 10, used: 9}},
			key:   "y", prompt: 20, maxTokens: 10, ok: true, slot: 1},
		{name: "running slots are never taken", cells: 1000, unified: true,
			slots: []slotSpec{{key: "a", tokens: 10, running: 20}, {key: "b", tokens: 10, running: 20}},
			key:   "y", prompt: 20, maxTokens: 10, ok: false},
		{name: "cells: idle conversations evicted LRU first until the reservation fits", cells: 100, unified: true,
			slots: []slotSpec{{key: "a", tokens: 30, used: 3}, {key: "b", tokens: 30, used: 1}, {key: "c", tokens: 30, used: 2}, {}},
			key:   "y", prompt: 30, maxTokens: 20, ok: true, slot: 3, evict: []int{1, 2}},
		{name: "cells: running reservations are never evicted", cells: 100, unified: true,
			slots: []slotSpec{{key: "a", tokens: 10, running: 80}, {}}, key: "y", prompt: 20, maxTokens: 10, ok: false},
		{name: "partitions: no cell accounting", cells: 100, unified: false,
			slots: []slotSpec{{key: "a", tokens: 10, running: 90}, {}}, key: "y", prompt: 50, maxTokens: 50, ok: true, slot: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := testEngine(tc.cells, tc.unified, tc.slots...)
			j := &job{req: infer.Request{SessionID: tc.key}, prompt: prompt(tc.prompt), maxTokens: tc.maxTokens}
			p, ok := e.place(j)
			if ok != tc.ok {
				t.Fatalf("place ok = %v, want %v", ok, tc.ok)
			}
			if !ok {
				return
			}
			var evicted []int
			for _, s := range p.evict {
				evicted = append(evicted, s.seq)
			}
			if p.slot.seq != tc.slot || p.reuse != tc.reuse || !slices.Equal(evicted, tc.evict) {
				t.Errorf("placement = slot %d reuse %d evict %v, want slot %d reuse %d evict %v",
					p.slot.seq, p.reuse, evicted, tc.slot, tc.reuse, tc.evict)
			}
		})
	}
}

// A refusal's Retry-After is the time the queue ahead takes to drain at the measured rate.
func TestOverloadedRetryAfter(t *testing.T) {
	e := &Engine{cfg: Config{QueueTimeout: 30 * time.Second}}
	start := time.Now()
	for i := range 5 { // a completion every 500ms
		e.done = append(e.done, start.Add(time.Duration(i)*500*time.Millisecond))
	}
	for _, tc := range []struct {
		waiting int
		want    time.Duration
	}{
		{0, time.Second},       // at least a second
		{9, 5 * time.Second},   // ten requests ahead, this one included
		{99, 30 * time.Second}, // never more than the queue timeout
	} {
		e.waiting = make([]*job, tc.waiting)
		var o *infer.OverloadedError
		if err := e.overloaded("queue full"); !errors.As(err, &o) || !errors.Is(err, infer.ErrOverloaded) || o.RetryAfter != tc.want {
			t.Errorf("%d waiting: %v, want retry after %v", tc.waiting, err, tc.want)
		}
	}
}

// A replica (a copy kept for another node's conversation) is evicted before any
// conversation served here, however recently it came.
func TestReplicasEvictedFirst(t *testing.T) {
	e := testEngine(1000, true, slotSpec{key: "a", tokens: 10, used: 1}, slotSpec{key: "b", tokens: 10, used: 9}, slotSpec{key: "c", tokens: 10, used: 5})
	if v := e.lru(nil, false); v.key != "a" {
		t.Fatalf("without replicas the least recently used goes first: got %q", v.key)
	}
	e.slots[1].replica = true
	if v := e.lru(nil, false); v.key != "b" {
		t.Errorf("evicted %q first, want the replica b", v.key)
	}
}

// TestPrefillOrder: prompts go shortest first within what the prefill rate gets through
// in the step's slice (1,280 tokens/s for 100ms: 128), a lone prompt takes the whole batch,
// one that waited prefillAge steps goes ahead of shorter ones, and a prompt after the
// first starts only whole or with half the budget.
func TestPrefillOrder(t *testing.T) {
	type spec struct {
		pending int
		since   uint64
		gen     int
	}
	for _, tc := range []struct {
		name     string
		tick     uint64
		jobs     []spec
		decoding int
		queued   bool     // an interactive request waits for admission
		rate     float64  // measured prefill tokens/s; 0 means 1,280, -1 none measured
		want     [][2]int // job index, tokens fed
	}{
		{name: "a burst: shortest first, 128 tokens a step, whole prompts", jobs: []spec{{50, 0, 0}, {40, 0, 0}, {45, 0, 0}, {200, 0, 0}},
			want: [][2]int{{1, 40}, {2, 45}}},
		{name: "a wave: one whole prompt a step, not a sliver of the next", jobs: []spec{{65, 0, 0}, {65, 0, 0}, {65, 0, 0}}, rate: 700,
			want: [][2]int{{0, 65}}},
		{name: "past a short prompt, a long one starts with half the budget", jobs: []spec{{900, 0, 0}, {20, 0, 0}},
			want: [][2]int{{1, 20}, {0, 108}}},
		{name: "a lone prompt uses the batch", jobs: []spec{{900, 0, 0}}, want: [][2]int{{0, 512}}},
		{name: "beside decoding streams, the budget", jobs: []spec{{1, 0, 3}, {900, 0, 0}}, decoding: 1,
			want: [][2]int{{1, 128}}},
		{name: "a prompt that waited goes first", tick: 20, jobs: []spec{{30, 19, 0}, {600, 2, 0}, {20, 18, 0}},
			want: [][2]int{{1, 128}}},
		{name: "then by remaining length", tick: 20, jobs: []spec{{30, 19, 0}, {60, 2, 0}, {20, 18, 0}},
			want: [][2]int{{1, 60}, {2, 20}, {0, 30}}},
		{name: "a slow engine still prefills something", jobs: []spec{{50, 0, 0}, {40, 0, 0}}, rate: 10,
			want: [][2]int{{1, 16}}},
		{name: "a fast one up to the batch", jobs: []spec{{1, 0, 3}, {900, 0, 0}}, decoding: 1, rate: 1e6,
			want: [][2]int{{1, 511}}},
		{name: "no rate measured yet: the batch", jobs: []spec{{1, 0, 3}, {900, 0, 0}}, decoding: 1, rate: -1,
			want: [][2]int{{1, 511}}},
		{name: "while a request queues for admission, the batch", jobs: []spec{{1, 0, 3}, {900, 0, 0}}, decoding: 1, queued: true,
			want: [][2]int{{1, 511}}},
		{name: "the batch holds whole prompts too", jobs: []spec{{400, 0, 0}, {300, 0, 0}}, rate: 1e6,
			want: [][2]int{{1, 300}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := &Engine{cfg: Config{PrefillSlice: 100 * time.Millisecond}, tick: tc.tick, batch: NewBatch(512)}
			for _, sp := range tc.jobs {
				e.jobs = append(e.jobs, &job{pending: prompt(sp.pending), since: sp.since, gen: sp.gen})
			}
			if tc.queued {
				e.waiting = []*job{{}}
			}
			var got [][2]int
			rate := tc.rate
			switch rate {
			case 0:
				rate = 1280
			case -1:
				rate = 0
			}
			for _, j := range e.prefillOrder(tc.decoding, rate) {
				got = append(got, [2]int{slices.Index(e.jobs, j), j.fed})
			}
			if !slices.Equal(got, tc.want) {
				t.Errorf("prefilled (job, tokens) %v, want %v", got, tc.want)
			}
		})
	}
}

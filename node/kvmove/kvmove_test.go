package kvmove

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/infernode/infernode/internal/poll"
	"github.com/infernode/infernode/node/hop"
	"github.com/infernode/infernode/session/infer"
)

// Tests of KV movement between a mover and real HTTP peers that verify every hop's
// signature, with a ring and an engine that the test scripts.

var key = []byte("0123456789abcdef0123456789abcdef")

// fakeRing is a cluster view the test writes.
type fakeRing struct {
	mu      sync.Mutex
	owner   map[string]Peer // keys another node owns
	heirs   []Peer
	prefill map[string]float64
	joined  time.Time
	leavers []Peer
}

func (f *fakeRing) Owner(k string) (Peer, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	p, ok := f.owner[k]
	return p, ok
}
func (f *fakeRing) Heirs(_ string, n int) []Peer    { return f.heirs[:min(n, len(f.heirs))] }
func (f *fakeRing) Prefill(p string) float64        { return f.prefill[p] }
func (f *fakeRing) Joined() time.Time               { return f.joined }
func (f *fakeRing) Leavers() []Peer                 { return f.leavers }
func (f *fakeRing) Happened(string, string, string) {}

// fakeLocal records the frames imported into it and holds nothing. A frame is "frame of
// KEY"; one of another key than the one asked for is refused, as the engine does.
type fakeLocal struct {
	mu     sync.Mutex
	frames []string
	held   infer.Frame // what a snapshot gives (nil: nothing held)
	convs  []string    // the conversations it lists
}

func (l *fakeLocal) Snapshot(context.Context, string) (infer.Frame, error) {
	if l.held == nil {
		return nil, infer.ErrNotCached
	}
	return l.held, nil
}
func (l *fakeLocal) Import(_ context.Context, b []byte, _ infer.Origin, want string) (infer.Imported, error) {
	if want != "" && string(b) != "frame of "+want {
		return infer.Imported{}, infer.ErrFrame
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.frames = append(l.frames, string(b))
	return infer.Imported{}, nil
}
func (l *fakeLocal) Conversations(context.Context) ([]string, error) { return l.convs, nil }
func (l *fakeLocal) Demote(context.Context, string) error            { return nil }
func (l *fakeLocal) Holds(string) bool                               { return false }
func (l *fakeLocal) Stats() infer.Stats                              { return infer.Stats{} }

// peer is a node's receiving end of KV movement: it verifies each hop, records the paths
// of the frames pushed to it, and answers pulls with "frame of KEY", signed (or as answer
// says, for the forgery tests).
type peer struct {
	Peer
	auth   *hop.Auth
	mu     sync.Mutex
	took   []string
	hashes []string                                       // the hash each frame pushed was signed over: "SHA-256" or "BLAKE3"
	answer func(key, nonce string, w http.ResponseWriter) // nil: the honest answer
	gate   chan struct{}                                  // when set, a push is taken only once it is closed
}

func startPeer(t *testing.T, id string) *peer {
	p := &peer{auth: hop.NewAuth(id, key, nil, time.Now, 30*time.Second)}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if err := p.auth.Authenticate(hop.Inbound{Method: r.Method, Path: r.URL.Path, Header: r.Header.Get, Body: body}); err != nil {
			w.WriteHeader(http.StatusUnauthorized)
			return
		}
		if p.gate != nil {
			<-p.gate
		}
		p.mu.Lock()
		p.took = append(p.took, r.URL.Path)
		if r.Header.Get(hop.HeaderBodyBLAKE3) != "" {
			p.hashes = append(p.hashes, "BLAKE3")
		} else if r.Header.Get(hop.HeaderBodyHash) != "" {
			p.hashes = append(p.hashes, "SHA-256")
		}
		p.mu.Unlock()
		if r.URL.Path == hop.PullPath {
			nonce := r.Header.Get(hop.HeaderNonce)
			if p.answer != nil {
				p.answer(string(body), nonce, w)
				return
			}
			frame := []byte("frame of " + string(body))
			p.auth.SignAnswer(w.Header().Set, hop.PullPath, r.Header.Get(hop.HeaderFrom), nonce, hop.SumOf(frame, false))
			w.Header().Set(hop.HeaderFrameBytes, strconv.Itoa(len(frame)))
			w.Write(frame)
		}
	}))
	t.Cleanup(srv.Close)
	p.Peer = Peer{ID: id, Addr: strings.TrimPrefix(srv.URL, "http://"), Minor: hop.Minor}
	return p
}

func (p *peer) frames() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.took)
}

func newMover(t *testing.T, ring Ring, local Local, edit func(*Config)) *Mover {
	cfg := DefaultConfig()
	cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	if edit != nil {
		edit(&cfg)
	}
	m, err := New(cfg, ring, local, hop.NewAuth("a", key, nil, time.Now, 30*time.Second), http.DefaultClient, time.Now)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// testFrame is a frame of size zero bytes, said to hold tokens.
type testFrame struct{ size, tokens int }

func (f testFrame) WriteTo(w io.Writer) (int64, error) {
	n, err := w.Write(make([]byte, f.size))
	return int64(n), err
}
func (f testFrame) Len() int    { return f.size }
func (f testFrame) Tokens() int { return f.tokens }
func (testFrame) Release()      {}

// memFrame is a frame in memory that can be read as a request body, as the engine's are.
type memFrame struct{ testFrame }

func (f memFrame) Reader() io.Reader { return bytes.NewReader(make([]byte, f.size)) }

// TestHandOffLeavesPlaced: a ring change hands the conversations this node holds but
// another owns to their owners, but one placed here by its owner (Away) stays while that
// node owns it; once its owner changes, it goes to the new one.
func TestHandOffLeavesPlaced(t *testing.T) {
	o1, o2 := startPeer(t, "o1"), startPeer(t, "o2")
	ring := &fakeRing{owner: map[string]Peer{"placed": o1.Peer, "spilled": o1.Peer}}
	m := newMover(t, ring, &fakeLocal{held: memFrame{testFrame{size: 64, tokens: 4}}, convs: []string{"placed", "spilled"}}, nil)
	m.Away("placed", "o1")
	if moved, failed := m.HandOff(t.Context(), false); moved != 1 || failed != 0 || len(o1.frames()) != 1 {
		t.Fatalf("moved %d, failed %d, o1 took %v: want the one conversation not placed here", moved, failed, o1.frames())
	}
	ring.mu.Lock()
	ring.owner = map[string]Peer{"placed": o2.Peer}
	ring.mu.Unlock()
	if moved, _ := m.HandOff(t.Context(), false); moved != 1 || len(o2.frames()) != 1 {
		t.Fatalf("after its owner changed: moved %d, o2 took %v, want the placed conversation", moved, o2.frames())
	}
}

// TestHandOffAlone: the ring's last node leaving has no one to hand its conversations to:
// nothing moves and nothing failed (it used to warn once a conversation).
func TestHandOffAlone(t *testing.T) {
	m := newMover(t, &fakeRing{}, &fakeLocal{held: memFrame{testFrame{size: 64, tokens: 4}}, convs: []string{"a", "b"}}, nil)
	if moved, failed := m.HandOff(t.Context(), true); moved != 0 || failed != 0 {
		t.Errorf("moved %d, failed %d, want neither", moved, failed)
	}
}

// TestPushes: a replica goes, signed, to every heir (up to Replicas) on the replica path;
// a hand-off on leaving to the first heir; a push to the owner to the owner; with no one
// to take it, ErrNoOwner.
func TestPushes(t *testing.T) {
	b, c, d := startPeer(t, "b"), startPeer(t, "c"), startPeer(t, "d")
	ring := &fakeRing{owner: map[string]Peer{"moved": d.Peer}, heirs: []Peer{b.Peer, c.Peer}}
	m := newMover(t, ring, &fakeLocal{}, func(c *Config) { c.Replicas = 2 })
	for _, tc := range []struct {
		key   string
		why   Why
		frame infer.Frame
		sent  []string
	}{
		{"k", Replica, testFrame{1000, 10}, []string{"b", "c"}},
		{"k", Leaving, testFrame{1000, 10}, []string{"b"}},
		{"moved", ToOwner, memFrame{testFrame{1000, 10}}, []string{"d"}}, // the body read from memory, not piped
	} {
		sent, err := m.PushFrame(t.Context(), tc.key, tc.frame, tc.why)
		if err != nil || !slices.Equal(sent, tc.sent) {
			t.Errorf("push %d of %q: sent to %v (%v), want %v", tc.why, tc.key, sent, err, tc.sent)
		}
	}
	if got, want := b.frames(), []string{hop.ReplicaPath, hop.KVPath}; !slices.Equal(got, want) {
		t.Errorf("b took %v, want %v", got, want)
	}
	// The peers that took a replica are remembered (placement moves turns to them); a
	// push that is no replica leaves no such record.
	if got := m.Replicas("k"); !slices.Equal(got, []string{"b", "c"}) {
		t.Errorf("replicas of k: %v, want [b c]", got)
	}
	if got := m.Replicas("moved"); got != nil {
		t.Errorf("replicas of a conversation pushed to its owner: %v, want none", got)
	}
	if got, want := c.frames(), []string{hop.ReplicaPath}; !slices.Equal(got, want) {
		t.Errorf("c took %v, want %v", got, want)
	}
	if got, want := d.frames(), []string{hop.KVPath}; !slices.Equal(got, want) {
		t.Errorf("d took %v, want %v", got, want)
	}
	if _, err := m.PushFrame(t.Context(), "own", testFrame{1000, 10}, ToOwner); !errors.Is(err, ErrNoOwner) {
		t.Errorf("push of a conversation this node owns: %v, want ErrNoOwner", err)
	}
	// A peer with another secret refuses the frame: the push fails, naming the peer.
	m2, err := New(DefaultConfig(), ring, &fakeLocal{}, hop.NewAuth("a", []byte("another key of sixteen+ bytes"), nil, time.Now, time.Minute),
		http.DefaultClient, time.Now)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m2.PushFrame(t.Context(), "moved", memFrame{testFrame{10, 1}}, ToOwner); err == nil || !strings.Contains(err.Error(), "push KV to d") {
		t.Errorf("push signed with another key: %v, want refused by d", err)
	}
}

// TestKeepWarm: after a turn, its replica goes in the background (KeepWarm returns while
// the heir has not taken it yet: the answer's end does not wait for it); while draining,
// the hand-off has landed when KeepWarm returns (the next turn goes there).
func TestKeepWarm(t *testing.T) {
	b := startPeer(t, "b")
	gate := make(chan struct{})
	b.gate = gate
	open := sync.OnceFunc(func() { close(gate) })
	t.Cleanup(open) // before the peer's server closes, which waits for its handlers
	m := newMover(t, &fakeRing{heirs: []Peer{b.Peer}}, &fakeLocal{held: memFrame{testFrame{1000, 10}}}, nil)
	returned := make(chan struct{})
	go func() {
		m.KeepWarm("k", false)
		close(returned)
	}()
	select {
	case <-returned:
	case <-time.After(time.Second): // a push waiting on the gate gives up after 2s
		t.Fatal("KeepWarm waited for the replica's push")
	}
	if got := b.frames(); len(got) != 0 {
		t.Fatalf("b took %v before its gate opened", got)
	}
	open()
	if !poll.Within(10*time.Second, time.Millisecond, func() bool { return len(b.frames()) == 1 }) {
		t.Fatalf("the replica never landed: b took %v", b.frames())
	}
	m.KeepWarm("k", true)
	if got, want := b.frames(), []string{hop.ReplicaPath, hop.KVPath}; !slices.Equal(got, want) {
		t.Errorf("b took %v when the draining KeepWarm returned, want %v", got, want)
	}
}

// TestHashByVersion: a frame is signed over its BLAKE3 for a peer of hop 1.9 or later and
// over its SHA-256 for an older one, which knows no other hash; pushed (the peer checks
// the signature, as a node does) and answering a pull (the asker checks it).
func TestHashByVersion(t *testing.T) {
	b, c := startPeer(t, "b"), startPeer(t, "c")
	c.Minor = hop.MinorBLAKE3 - 1
	ring := &fakeRing{heirs: []Peer{b.Peer, c.Peer}}
	m := newMover(t, ring, &fakeLocal{}, func(c *Config) { c.Replicas = 2 })
	if sent, err := m.PushFrame(t.Context(), "k", memFrame{testFrame{1000, 10}}, Replica); err != nil || len(sent) != 2 {
		t.Fatalf("pushed to %v: %v", sent, err)
	}
	if !slices.Equal(b.hashes, []string{"BLAKE3"}) || !slices.Equal(c.hashes, []string{"SHA-256"}) {
		t.Errorf("frames signed over %v for hop 1.%d, %v for 1.%d; want BLAKE3, SHA-256", b.hashes, b.Minor, c.hashes, c.Minor)
	}

	giver := newMover(t, ring, &fakeLocal{held: testFrame{1000, 10}}, nil)
	asker := hop.NewAuth("b", key, nil, time.Now, 30*time.Second)
	for _, minor := range []int{hop.MinorBLAKE3, hop.MinorBLAKE3 - 1} {
		h := http.Header{}
		frame, err := giver.Give(t.Context(), "k", "b", "n0", minor, h.Set)
		if err != nil {
			t.Fatal(err)
		}
		var body bytes.Buffer
		frame.WriteTo(&body)
		if blake3 := h.Get(hop.HeaderBodyBLAKE3) != ""; blake3 != (minor >= hop.MinorBLAKE3) {
			t.Errorf("a pull of hop 1.%d answered over BLAKE3: %v", minor, blake3)
		}
		if err := asker.VerifyAnswer(h.Get, hop.PullPath, "a", "n0", body.Bytes()); err != nil {
			t.Errorf("a pull of hop 1.%d: %v", minor, err)
		}
	}
}

// TestTransferOrRecompute: a conversation moves by transfer only when its frame would
// arrive sooner, by the margin, than its owner would prefill its tokens; unknown rates
// move it (and so measure the link).
func TestTransferOrRecompute(t *testing.T) {
	b := startPeer(t, "b")
	ring := &fakeRing{owner: map[string]Peer{"k": b.Peer}, prefill: map[string]float64{}}
	m := newMover(t, ring, &fakeLocal{}, nil)
	push := func(tokens, size int) error {
		_, err := m.PushFrame(t.Context(), "k", testFrame{size, tokens}, ToOwner)
		return err
	}
	// Nothing known: it moves.
	if err := push(10, 1000); err != nil {
		t.Fatalf("push with no rates known: %v", err)
	}
	ring.prefill["b"] = 100 // tokens a second
	for _, tc := range []struct {
		tokens, size int
		move         bool
	}{
		{1000, 1 << 20, true},   // transfer ~1s, prefill 10s
		{100, 1 << 20, false},   // transfer ~1s, prefill 1s
		{100, 900_000, false},   // 0.9s, by the margin 1.125s, against 1s
		{125, 900_000, true},    // 1.125s against 1.25s
		{1, 100_000_000, false}, // 100 MB for a token
	} {
		m.mu.Lock()
		m.rates["b"] = 1e6 // bytes a second, as past pushes measured (a push updates it)
		m.mu.Unlock()
		n := len(b.frames())
		err := push(tc.tokens, tc.size)
		moved := len(b.frames()) == n+1
		if tc.move != moved || tc.move != (err == nil) || (!tc.move && !errors.Is(err, ErrRecompute)) {
			t.Errorf("%d tokens in %d bytes: moved %v (%v), want moved %v", tc.tokens, tc.size, moved, err, tc.move)
		}
	}
}

// TestBandwidth: pushes keep within the bandwidth bound.
func TestBandwidth(t *testing.T) {
	b := startPeer(t, "b")
	m := newMover(t, &fakeRing{owner: map[string]Peer{"k": b.Peer}}, &fakeLocal{}, func(c *Config) { c.Bandwidth = 8 }) // 1 MB a second
	size := 600_000
	start := time.Now()
	if _, err := m.PushFrame(t.Context(), "k", testFrame{size, 1_000_000}, ToOwner); err != nil {
		t.Fatal(err)
	}
	// The first burst goes at once; the rest at 1 MB a second.
	if took, least := time.Since(start), time.Duration(float64(size-m.limit.Burst())/1e6*float64(time.Second)); took < least {
		t.Errorf("%d bytes at 8 Mbit/s took %v, at least %v expected", size, took, least)
	}
}

// TestPullOnMiss: the first turn of a conversation this node took over at its last ring
// change pulls its KV from the node that owned it before, once, and the turn goes on
// whether the pull worked or not; after the pull window nothing is pulled, and nothing is
// asked of an owner too old to sign its answer.
func TestPullOnMiss(t *testing.T) {
	b := startPeer(t, "b")
	gone := httptest.NewServer(http.NotFoundHandler())
	gone.Close() // an old owner that does not answer: the pull fails, the turn runs cold
	ring := &fakeRing{heirs: []Peer{b.Peer}}
	local := &fakeLocal{}
	now := time.Unix(1_800_000_000, 0)
	m := newMover(t, ring, local, nil)
	m.now = func() time.Time { return now }
	turn := func(key string, followUp bool) {
		m.BeforeServe(t.Context(), infer.Request{SessionID: key, FollowUp: followUp, Prompt: "hi"})
	}
	turn("moved", true)
	if len(local.frames) != 0 {
		t.Fatalf("pulled before this node joined: %q", local.frames)
	}
	ring.joined = now
	turn("moved", false) // a first turn has nothing to pull
	for range 2 {
		turn("moved", true)
	}
	ring.heirs = []Peer{{ID: "c", Addr: strings.TrimPrefix(gone.URL, "http://"), Minor: hop.Minor}}
	turn("unreachable", true)
	old := b.Peer
	old.Minor = hop.MinorSignedPull - 1
	ring.heirs = []Peer{old}
	turn("held by an old node", true)
	if len(local.frames) != 1 {
		t.Errorf("imported %q: a node of hop 1.%d was asked for a pull", local.frames, old.Minor)
	}
	if !slices.Equal(local.frames, []string{"frame of moved"}) {
		t.Errorf("imported %q, want only the frame of moved, once", local.frames)
	}
	ring.heirs = []Peer{b.Peer}
	now = now.Add(PullWindow + time.Second)
	turn("later", true)
	if len(local.frames) != 1 {
		t.Errorf("pulled after the pull window: %q", local.frames)
	}
}

// TestPullFromLeavers: a node long on the ring that does not hold a conversation's KV asks
// the members that left lately for it (a leaver drains and pushes its caches off, and the
// next turn may come first), in turn until one sends it, once; a first turn asks nothing,
// and with no leaver nothing is asked.
func TestPullFromLeavers(t *testing.T) {
	b := startPeer(t, "b")
	gone := httptest.NewServer(http.NotFoundHandler())
	gone.Close() // a leaver that has exited
	now := time.Unix(1_800_000_000, 0)
	ring := &fakeRing{joined: now.Add(-time.Hour)}
	local := &fakeLocal{}
	m := newMover(t, ring, local, nil)
	m.now = func() time.Time { return now }
	turn := func(key string, followUp bool) {
		m.BeforeServe(t.Context(), infer.Request{SessionID: key, FollowUp: followUp, Prompt: "hi"})
	}
	turn("before", true)
	ring.leavers = []Peer{{ID: "c", Addr: strings.TrimPrefix(gone.URL, "http://"), Minor: hop.Minor}, b.Peer}
	turn("new", false)
	turn("left", true)
	turn("left", true)
	if !slices.Equal(local.frames, []string{"frame of left"}) {
		t.Errorf("imported %q, want the frame of left, once", local.frames)
	}
}

// TestPullAnswerBound: a pulled frame is installed only when the node asked signed it for
// this very pull and it is of the conversation asked for: an unsigned answer, one signed
// for another pull, one signed with another key, one shorter than the size it declares,
// and a frame of another conversation change nothing.
func TestPullAnswerBound(t *testing.T) {
	b := startPeer(t, "b")
	local := &fakeLocal{}
	ring := &fakeRing{heirs: []Peer{b.Peer}, joined: time.Now()}
	m := newMover(t, ring, local, nil)
	other := hop.NewAuth("b", []byte("another key of sixteen+ bytes"), nil, time.Now, 30*time.Second)
	for name, answer := range map[string]func(key, nonce string, w http.ResponseWriter){
		"unsigned": func(key, _ string, w http.ResponseWriter) { w.Write([]byte("frame of " + key)) },
		"signed for another pull": func(key, _ string, w http.ResponseWriter) {
			f := []byte("frame of " + key)
			b.auth.SignAnswer(w.Header().Set, hop.PullPath, "a", strings.Repeat("ab", 16), hop.SumOf(f, false))
			w.Write(f)
		},
		"signed with another key": func(key, nonce string, w http.ResponseWriter) {
			f := []byte("frame of " + key)
			other.SignAnswer(w.Header().Set, hop.PullPath, "a", nonce, hop.SumOf(f, false))
			w.Write(f)
		},
		"shorter than it says": func(key, nonce string, w http.ResponseWriter) {
			f := []byte("frame of " + key)
			b.auth.SignAnswer(w.Header().Set, hop.PullPath, "a", nonce, hop.SumOf(f, false))
			w.Header().Set(hop.HeaderFrameBytes, strconv.Itoa(len(f)+1))
			w.Write(f)
		},
		"another conversation": func(_, nonce string, w http.ResponseWriter) {
			f := []byte("frame of someone-else")
			b.auth.SignAnswer(w.Header().Set, hop.PullPath, "a", nonce, hop.SumOf(f, false))
			w.Write(f)
		},
	} {
		b.answer = answer
		m.BeforeServe(t.Context(), infer.Request{SessionID: "conv-" + name, FollowUp: true, Prompt: "hi"})
		if len(local.frames) != 0 {
			t.Fatalf("%s: installed %q", name, local.frames)
		}
	}
	b.answer = nil
	m.BeforeServe(t.Context(), infer.Request{SessionID: "honest", FollowUp: true, Prompt: "hi"})
	if !slices.Equal(local.frames, []string{"frame of honest"}) {
		t.Errorf("the honest answer: installed %q", local.frames)
	}
}

// TestPullTimeout: a pull gives up after pullTimeout, unless the prefill it saves is
// longer: then it may take twice that (a long prompt's frame on a slow link).
func TestPullTimeout(t *testing.T) {
	defer func(d time.Duration) { pullTimeout = d }(pullTimeout)
	pullTimeout = 50 * time.Millisecond
	b := startPeer(t, "b")
	b.answer = func(key, nonce string, w http.ResponseWriter) {
		time.Sleep(200 * time.Millisecond) // a slow link
		f := []byte("frame of " + key)
		b.auth.SignAnswer(w.Header().Set, hop.PullPath, "a", nonce, hop.SumOf(f, false))
		w.Write(f)
	}
	local := &fakeLocal{}
	m := newMover(t, &fakeRing{joined: time.Now()}, local, nil)
	if n, err := m.Fetch(t.Context(), b.Peer, "short", infer.Prefix, 10*time.Millisecond); err == nil || n != 0 {
		t.Errorf("a pull saving 10ms outlived its 50ms: %d bytes, err %v", n, err)
	}
	if n, err := m.Fetch(t.Context(), b.Peer, "long", infer.Prefix, time.Second); err != nil || n == 0 {
		t.Errorf("a pull saving a second gave up: %d bytes, err %v", n, err)
	}
	if !slices.Equal(local.frames, []string{"frame of long"}) {
		t.Errorf("installed %q, want the long one's frame only", local.frames)
	}
}

package session

import (
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/cespare/xxhash/v2"
)

func TestTextFilter(t *testing.T) {
	tests := []struct {
		name    string
		stops   []string
		pieces  []string
		want    []string // text returned by each push
		stopped bool
		flushed string
	}{
		{"plain", nil, []string{" a", " b"}, []string{" a", " b"}, false, ""},
		{"stop inside one piece", []string{"END"}, []string{" xENDy"}, []string{" x"}, true, ""},
		{"stop split over pieces", []string{"r wa"}, []string{" the", " river", " water"}, []string{" the", " rive", ""}, true, ""},
		{"false start released", []string{"abc"}, []string{"xab", "d"}, []string{"x", "abd"}, false, ""},
		{"prefix held at end", []string{"abc"}, []string{"xab"}, []string{"x"}, false, "ab"},
		{"earliest stop wins", []string{"c", "ab"}, []string{"xabc"}, []string{"x"}, true, ""},
		{"utf8 split", nil, []string{"\xe6\x97", "\xa5", "\xe6", "\x9c\xac!"}, []string{"", "日", "", "本!"}, false, ""},
		{"utf8 incomplete at end", nil, []string{"a\xe6\x97"}, []string{"a"}, false, "\uFFFD"},
		{"invalid byte passes as U+FFFD", nil, []string{"a\xffb"}, []string{"a\uFFFDb"}, false, ""},
		{"stop after multibyte", []string{"本"}, []string{"日\xe6\x9c", "\xac"}, []string{"日", ""}, true, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newTextFilter(tt.stops)
			stopped := false
			for i, p := range tt.pieces {
				got, s := f.push([]byte(p))
				if got != tt.want[i] {
					t.Errorf("push(%q) = %q, want %q", p, got, tt.want[i])
				}
				if s {
					stopped = true
					break
				}
			}
			if stopped != tt.stopped {
				t.Errorf("stopped = %v, want %v", stopped, tt.stopped)
			}
			if got := f.flush(); got != tt.flushed {
				t.Errorf("flush() = %q, want %q", got, tt.flushed)
			}
		})
	}
}

// FuzzTextFilter checks that whatever the pieces, emitted text is valid UTF-8, never
// contains a stop string, and without a stop equals the input.
func FuzzTextFilter(f *testing.F) {
	f.Add("the river runs", "r r", 3)
	f.Add("日本語テキスト", "語", 2)
	f.Fuzz(func(t *testing.T, text, stop string, cut int) {
		if stop == "" || cut <= 0 {
			return
		}
		tf := newTextFilter([]string{stop})
		var out strings.Builder
		stopped := false
		for i := 0; i < len(text) && !stopped; i += cut {
			s, st := tf.push([]byte(text[i:min(i+cut, len(text))]))
			if !utf8.ValidString(s) {
				t.Fatalf("emitted invalid UTF-8 %q", s)
			}
			out.WriteString(s)
			stopped = st
		}
		if !stopped {
			out.WriteString(tf.flush())
		}
		got := out.String()
		if strings.Contains(got, stop) && utf8.ValidString(stop) {
			t.Fatalf("output %q contains stop %q", got, stop)
		}
		if idx := strings.Index(text, stop); idx >= 0 {
			if !stopped || got != strings.ToValidUTF8(text[:idx], "\uFFFD") && utf8.ValidString(text) {
				t.Fatalf("text %q stop %q: got %q stopped=%v", text, stop, got, stopped)
			}
		} else if utf8.ValidString(text) && got != text {
			t.Fatalf("text %q: got %q", text, got)
		}
	})
}

func TestConfigValidate(t *testing.T) {
	c := DefaultConfig()
	c.ModelPath = "m.gguf"
	if err := c.Validate(); err != nil {
		t.Fatalf("default config: %v", err)
	}
	c.FlashAttn = false
	if err := c.Validate(); err != nil {
		t.Fatalf("an f16 cache without flash attention: %v", err)
	}
	c.KVType = "q8_0"
	if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "needs flash attention") {
		t.Errorf("a q8_0 cache without flash attention: %v, want refused", err)
	}
	c = Config{}
	err := c.Validate()
	for _, want := range []string{"model path", "sequences", "KV cells", "threads", "KV type", "default max tokens", "queue timeout"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Validate(zero config) = %v, want it to mention %q", err, want)
		}
	}
}

// TestFingerprintKVLayout: the fingerprint tells apart what shapes the KV cache (its type,
// and flash attention, without which V is stored transposed), and with the defaults it is
// what it was before flash attention was a setting (nodes of earlier versions share the
// ring during a rolling upgrade).
func TestFingerprintKVLayout(t *testing.T) {
	path := filepath.Join(t.TempDir(), "m.gguf")
	if err := os.WriteFile(path, []byte("weights"), 0o644); err != nil {
		t.Fatal(err)
	}
	c := DefaultConfig()
	c.ModelPath = path
	fp := func(c Config) string {
		s, err := Fingerprint(c)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	h := xxhash.New()
	h.WriteString("weights\x00kv=f16")
	if got, before := fp(c), strconv.FormatUint(h.Sum64(), 16); got != before {
		t.Errorf("default fingerprint %s, want %s as before the setting", got, before)
	}
	noFlash, q8 := c, c
	noFlash.FlashAttn, q8.KVType = false, "q8_0"
	if fp(noFlash) == fp(c) || fp(q8) == fp(c) || fp(noFlash) == fp(q8) {
		t.Errorf("fingerprints %s (default), %s (no flash attention), %s (q8_0): want all different", fp(c), fp(noFlash), fp(q8))
	}
}

// TestContinuation: a stream says which tokens the text its reader has received spells:
// all of them while the filter holds nothing back; not one whose piece is partly held (a
// stop string's beginning, an incomplete character); and none exactly once some text did
// not spell its piece (an invalid byte replaced).
func TestContinuation(t *testing.T) {
	type tok struct {
		id    int32
		piece string
	}
	run := func(stops []string, toks []tok) (ids []int32, tail int, ok bool, text string) {
		f, st, out := newTextFilter(stops), newStream(), 0
		for _, tk := range toks {
			s, _ := f.push([]byte(tk.piece))
			out += len(tk.piece)
			st.push(s, tk.id, out, f.pending())
		}
		text, _ = st.Recv()
		ids, tail, ok = st.Continuation(0)
		return ids, tail, ok, text
	}
	for _, tc := range []struct {
		name  string
		stops []string
		toks  []tok
		ids   []int32
		tail  int
		ok    bool
	}{
		{"plain", nil, []tok{{5, "ab"}, {6, "c"}}, []int32{5, 6}, 0, true},
		{"a stop string's beginning held", []string{"cX"}, []tok{{5, "ab"}, {6, "c"}}, []int32{5}, 0, true},
		{"a piece partly held", []string{"bcX"}, []tok{{5, "ab"}, {6, "c"}}, nil, 1, true},
		{"an incomplete character", nil, []tok{{5, "a\xe2\x82"}, {6, "\xac"}}, []int32{5, 6}, 0, true},
		{"an incomplete character held", nil, []tok{{5, "a"}, {6, "\xe2\x82"}}, []int32{5}, 0, true},
		{"an invalid byte", nil, []tok{{5, "a\xff"}, {6, "b"}}, []int32{5, 6}, 0, false},
	} {
		ids, tail, ok, text := run(tc.stops, tc.toks)
		if !slices.Equal(ids, tc.ids) || tail != tc.tail || ok != tc.ok {
			t.Errorf("%s: text %q: tokens %v, tail %d, exact %v; want %v, %d, %v", tc.name, text, ids, tail, ok, tc.ids, tc.tail, tc.ok)
		}
	}
}

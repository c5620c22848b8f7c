package hop

import (
	"strings"
	"testing"
	"time"
)

// A rotation: a hop signed with a secret this node only accepts is verified; one signed
// with a secret it does not know is refused; none of them can be replayed.
func TestAuthRotation(t *testing.T) {
	now := func() time.Time { return time.Unix(1_800_000_000, 0) }
	oldKey, newKey := []byte("old-secret-0123456789abcdef"), []byte("new-secret-0123456789abcdef")
	receiver := NewAuth("a", oldKey, [][]byte{newKey}, now, 30*time.Second)
	body := []byte(`{"prompt":"hi"}`)
	for _, tc := range []struct {
		name string
		key  []byte
		ok   bool
	}{{"primary", oldKey, true}, {"accepted", newKey, true}, {"unknown", []byte("another-secret-0123456789"), false}} {
		h := map[string]string{}
		NewAuth("b", tc.key, nil, now, 30*time.Second).Sign(func(k, v string) { h[k] = v }, "POST", Path, "a", body)
		in := Inbound{Method: "POST", Path: Path, Body: body, Header: func(k string) string { return h[k] }}
		if err := receiver.Authenticate(in); (err == nil) != tc.ok {
			t.Errorf("%s key: verify = %v, want ok %v", tc.name, err, tc.ok)
		}
		if err := receiver.Authenticate(in); err == nil {
			t.Errorf("%s key: a replay was accepted", tc.name)
		}
	}
}

// TestStampedBeforeStart: a node refuses hops stamped before it started, even within the
// replay window: its nonce cache did not see what its previous run answered.
func TestStampedBeforeStart(t *testing.T) {
	now := time.Unix(1_800_000_000, 0)
	clock := func() time.Time { return now }
	receiver := NewAuth("a", []byte("secret-0123456789abcdef"), nil, clock, 30*time.Second)
	h := map[string]string{}
	sender := NewAuth("b", []byte("secret-0123456789abcdef"), nil, func() time.Time { return now.Add(-time.Second) }, 30*time.Second)
	sender.Sign(func(k, v string) { h[k] = v }, "POST", Path, "a", nil)
	if err := receiver.Authenticate(Inbound{Method: "POST", Path: Path, Header: func(k string) string { return h[k] }}); err == nil ||
		!strings.Contains(err.Error(), "before this node started") {
		t.Errorf("a hop stamped a second before the receiver started: %v", err)
	}
}

// TestSumKinds: a frame signed over its BLAKE3 is verified by its BLAKE3, whole or from
// the headers alone; a signature over one kind of sum does not pass for the other (a
// header that names the other hash), nor over a changed body.
func TestSumKinds(t *testing.T) {
	now := func() time.Time { return time.Unix(1_800_000_000, 0) }
	key := []byte("secret-0123456789abcdef")
	receiver := NewAuth("a", key, nil, now, 30*time.Second)
	sender := NewAuth("b", key, nil, now, 30*time.Second)
	body := []byte("a KV frame")
	for _, blake3 := range []bool{false, true} {
		sign := func() map[string]string {
			h := map[string]string{}
			sender.SignHash(func(k, v string) { h[k] = v }, "POST", KVPath, "a", SumOf(body, blake3))
			return h
		}
		in := func(h map[string]string, body []byte) Inbound {
			return Inbound{Method: "POST", Path: KVPath, Body: body, Header: func(k string) string { return h[k] }}
		}
		h := sign()
		if err := receiver.Preverify("POST", KVPath, in(h, nil).Header); err != nil {
			t.Errorf("BLAKE3 %v: preverify: %v", blake3, err)
		}
		if err := receiver.Authenticate(in(h, body)); err != nil {
			t.Errorf("BLAKE3 %v: %v", blake3, err)
		}
		if err := receiver.Authenticate(in(sign(), []byte("another frame"))); err == nil {
			t.Errorf("BLAKE3 %v: a changed body was accepted", blake3)
		}
		// The same signature, the header naming the other hash (with that hash's true sum).
		h = sign()
		other := SumOf(body, !blake3)
		delete(h, SumOf(body, blake3).Header())
		h[other.Header()] = other.Hex()
		if err := receiver.Preverify("POST", KVPath, in(h, nil).Header); err == nil {
			t.Errorf("BLAKE3 %v: a signature passed for the other hash's sum, headers only", blake3)
		}
		if err := receiver.Authenticate(in(h, body)); err == nil {
			t.Errorf("BLAKE3 %v: a signature passed for the other hash's sum", blake3)
		}
	}
	// Answers: the asker checks the hash the answer names.
	for _, blake3 := range []bool{false, true} {
		h := map[string]string{}
		sender.SignAnswer(func(k, v string) { h[k] = v }, PullPath, "a", "n0", SumOf(body, blake3))
		if err := receiver.VerifyAnswer(func(k string) string { return h[k] }, PullPath, "b", "n0", body); err != nil {
			t.Errorf("BLAKE3 %v: answer: %v", blake3, err)
		}
		delete(h, HeaderBodyBLAKE3)
		if blake3 {
			h[HeaderBodyHash] = "x"
		} else {
			h[HeaderBodyBLAKE3] = "x"
		}
		if err := receiver.VerifyAnswer(func(k string) string { return h[k] }, PullPath, "b", "n0", body); err == nil {
			t.Errorf("BLAKE3 %v: an answer passed for the other hash's sum", blake3)
		}
	}
}

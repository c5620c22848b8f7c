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

package hop

import (
	"crypto/hmac"
	"encoding/hex"
	"testing"
	"time"
)

// FuzzAccept: whatever a hop's headers and body hold, the receiving end refuses it or
// decodes it, and never panics; a hop it accepts carries a signature over exactly what it
// received.
func FuzzAccept(f *testing.F) {
	key := []byte("fuzz-secret-0123456789")
	now := func() time.Time { return time.Unix(1_800_000_000, 0) }
	sign := func(body string) {
		h := map[string]string{}
		NewAuth("b", key, nil, now, 30*time.Second).Sign(func(k, v string) { h[k] = v }, "POST", Path, "a", []byte(body))
		f.Add(h[HeaderVersion], h[HeaderTime], h[HeaderNonce], h[HeaderSignature], body)
	}
	sign(`{"model":"m","session_id":"s","prompt":"hi","temperature":0,"top_p":1,"seed":0}`)
	sign(`{"model":"m","messages":[{"role":"user","content":"x"}],"share":"t:a:00"}`)
	f.Add("2.0", "1800000000000", "00112233445566778899aabbccddeeff", "00", `{}`)
	f.Add("1.4", "-1", "", "zz", `not json`)
	f.Fuzz(func(t *testing.T, version, ts, nonce, sig, body string) {
		a := NewAuth("a", key, nil, now, 30*time.Second)
		headers := map[string]string{HeaderFrom: "b", HeaderTo: "a", HeaderVersion: version, HeaderTime: ts,
			HeaderNonce: nonce, HeaderSignature: sig}
		in := Inbound{Method: "POST", Path: Path, Body: []byte(body), Header: func(k string) string { return headers[k] }}
		if _, err := a.Accept(in); err != nil {
			return
		}
		// Accepted: the signature must be the one over what arrived.
		want := mac(key, "POST", Path, "b", "a", version, ts, nonce, SumOf([]byte(body), false))
		if got, _ := hex.DecodeString(sig); !hmac.Equal(got, want) {
			t.Fatalf("accepted a hop whose signature %q is not over what arrived", sig)
		}
		if _, err := a.Accept(in); err == nil {
			t.Fatal("the same hop was accepted twice")
		}
	})
}

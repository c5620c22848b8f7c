package hop

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"io"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/zeebo/blake3"

	"github.com/infernode/infernode/session/infer"
)

// A Sum is the hash of a hop's body that its signature covers: SHA-256, or, since 1.9,
// BLAKE3-256 (a KV frame is hashed twice a transfer, once at each end, and BLAKE3 runs
// twice as fast as SHA-256 with the SHA extensions on one core: see docs/BENCHMARKS.md,
// "KV at line rate"). A signature
// covers the name of the hash too, so one of either kind cannot pass for the other.
type Sum struct {
	BLAKE3 bool
	Hash   [32]byte
}

// NewHash returns the hash a Sum of the kind is taken with.
func NewHash(useBLAKE3 bool) hash.Hash {
	if useBLAKE3 {
		return blake3.New()
	}
	return sha256.New()
}

// SumOf is body's Sum of the kind.
func SumOf(body []byte, useBLAKE3 bool) Sum {
	if useBLAKE3 {
		return Sum{BLAKE3: true, Hash: blake3.Sum256(body)}
	}
	return Sum{Hash: sha256.Sum256(body)}
}

// HashFor returns the hash a hop's or an answer's body is summed with, as its headers say.
func HashFor(header func(string) string) hash.Hash { return NewHash(usesBLAKE3(header)) }

// ReadHashing reads len(dst) bytes of r into dst and writes them to h as they arrive, a
// piece at a time, so that hashing a KV frame overlaps its arrival rather than following
// it (over a link slower than the hash, the hash then adds next to nothing: see
// docs/BENCHMARKS.md, "KV at line rate").
func ReadHashing(r io.Reader, dst []byte, h hash.Hash) error {
	const piece = 256 << 10 // hashed while it is still in the core's cache
	for off := 0; off < len(dst); {
		n, err := io.ReadFull(r, dst[off:min(off+piece, len(dst))])
		h.Write(dst[off : off+n])
		off += n
		if err != nil {
			return err
		}
	}
	return nil
}

// SumFrom is the Sum h (made by NewHash) has taken.
func SumFrom(h hash.Hash) Sum {
	_, b3 := h.(*blake3.Hasher)
	return Sum{BLAKE3: b3, Hash: [32]byte(h.Sum(nil))}
}

// Header is the header that carries the sum: HeaderBodyHash or HeaderBodyBLAKE3.
func (s Sum) Header() string {
	if s.BLAKE3 {
		return HeaderBodyBLAKE3
	}
	return HeaderBodyHash
}

// Hex is the sum as its header carries it.
func (s Sum) Hex() string { return hex.EncodeToString(s.Hash[:]) }

// signed is the sum as a signature covers it: the SHA-256's hex, as since 1.0, or
// "blake3:" and the hex.
func (s Sum) signed() string {
	if s.BLAKE3 {
		return "blake3:" + s.Hex()
	}
	return s.Hex()
}

// usesBLAKE3 reports whether a hop's or an answer's body was hashed with BLAKE3: it says
// so with HeaderBodyBLAKE3 (whose value the signature checks, not this).
func usesBLAKE3(header func(string) string) bool { return header(HeaderBodyBLAKE3) != "" }

// Errors of the receiving end. Test with errors.Is.
var (
	// ErrUnauthorized: the hop is unsigned, forged, stale or replayed (HTTP 401).
	ErrUnauthorized = errors.New("hop not authenticated")
	// ErrVersion: the hop's protocol major version is not spoken here (HTTP 400).
	ErrVersion = errors.New("hop protocol version not supported")
)

// Inbound is a received hop request, as node's HTTP server hands it over.
type Inbound struct {
	Method, Path string
	Header       func(name string) string
	Body         []byte
}

// Accept authenticates a hop addressed to this node and decodes its body. Fields a newer
// minor version added are ignored.
func (a *Auth) Accept(in Inbound) (Request, error) {
	if err := a.Authenticate(in); err != nil {
		return Request{}, err
	}
	var req Request
	if err := json.Unmarshal(in.Body, &req); err != nil {
		return Request{}, fmt.Errorf("%w: hop body: %v", infer.ErrInvalid, err)
	}
	return req, nil
}

// Authenticate authenticates a hop addressed to this node (any path) and checks its
// protocol version; the body is the caller's to read.
func (a *Auth) Authenticate(in Inbound) error {
	var sum Sum
	if len(a.keys) > 0 {
		sum = SumOf(in.Body, usesBLAKE3(in.Header))
	}
	return a.AuthenticateSum(in, sum)
}

// AuthenticateSum is Authenticate for a hop whose body the caller read and hashed as it
// arrived (with HashFor and ReadHashing): sum is that body's, and in.Body is not read.
func (a *Auth) AuthenticateSum(in Inbound, sum Sum) error {
	if err := a.check(in, sum, true); err != nil {
		return err
	}
	return checkVersion(in.Header(HeaderVersion))
}

// checkVersion refuses a hop of a major version this node does not speak.
func checkVersion(v string) error {
	major, _, _ := strings.Cut(v, ".")
	if n, err := strconv.Atoi(major); err != nil || n != Major {
		return fmt.Errorf("%w: got %q, this node speaks %d.x", ErrVersion, v, Major)
	}
	return nil
}

// Auth signs this node's hops and verifies those addressed to it, with the cluster secret.
// A hop's signature covers its method, path, sender, destination, protocol version,
// timestamp, nonce and the Sum of its body; a receiver refuses a timestamp more than
// maxSkew from its clock and any nonce it has seen within that window.
type Auth struct {
	self    string
	started time.Time // hops stamped earlier are refused: the nonces seen before a restart are gone
	keys    [][]byte  // the first signs, any verifies; none: insecure, hops unsigned and unchecked
	now     func() time.Time
	maxSkew time.Duration

	mu    sync.Mutex
	seen  map[string]time.Time // nonce → when it may be forgotten
	order []string             // nonces in arrival order, for pruning
}

// NewAuth signs as self with key and accepts signatures by key or any of accept. Without
// a key, hops go unsigned and are not checked (an insecure cluster). now is the clock.
func NewAuth(self string, key []byte, accept [][]byte, now func() time.Time, maxSkew time.Duration) *Auth {
	a := &Auth{self: self, now: now, started: now(), maxSkew: maxSkew, seen: map[string]time.Time{}}
	if len(key) > 0 {
		a.keys = append([][]byte{key}, accept...)
	}
	return a
}

// Sign sets the hop headers of a request from this node to dest.
func (a *Auth) Sign(set func(name, value string), method, path, dest string, body []byte) {
	a.sign(set, method, path, dest, SumOf(body, false))
}

// SignHash is Sign for a body of which only the Sum is at hand (a KV frame pushed); it
// sets the header that carries the sum too.
func (a *Auth) SignHash(set func(name, value string), method, path, dest string, body Sum) {
	set(body.Header(), body.Hex())
	a.sign(set, method, path, dest, body)
}

func (a *Auth) sign(set func(name, value string), method, path, dest string, body Sum) {
	self := a.self
	ts := strconv.FormatInt(a.now().UnixMilli(), 10)
	var n [16]byte
	rand.Read(n[:])
	nonce := hex.EncodeToString(n[:])
	version := fmt.Sprintf("%d.%d", Major, Minor)
	set(HeaderFrom, self)
	set(HeaderTo, dest)
	set(HeaderVersion, version)
	set(HeaderTime, ts)
	set(HeaderNonce, nonce)
	if len(a.keys) > 0 {
		set(HeaderSignature, hex.EncodeToString(mac(a.keys[0], method, path, self, dest, version, ts, nonce, body)))
	}
}

// mac is the signature of a hop whose body has the sum.
func mac(key []byte, method, path, from, to, version, ts, nonce string, sum Sum) []byte {
	m := hmac.New(sha256.New, key)
	for _, part := range []string{"infernode-hop", method, path, from, to, version, ts, nonce, sum.signed()} {
		m.Write([]byte(part))
		m.Write([]byte{'\n'})
	}
	return m.Sum(nil)
}

// Preverify checks, when only a hop's headers have arrived, the signature over the body's
// Sum the sender claims (HeaderBodyHash or HeaderBodyBLAKE3): a body may be allowed a
// larger size only then. It records nothing (Authenticate does, over the body itself),
// and refuses a nonce already seen, so a replayed hop gets no larger limit either.
func (a *Auth) Preverify(method, path string, header func(string) string) error {
	sum := Sum{BLAKE3: usesBLAKE3(header)}
	claimed, err := hex.DecodeString(header(sum.Header()))
	if err != nil || len(claimed) != len(sum.Hash) {
		return fmt.Errorf("%w: no body hash", ErrUnauthorized)
	}
	sum.Hash = [32]byte(claimed)
	in := Inbound{Method: method, Path: path, Header: header}
	if err := a.check(in, sum, false); err != nil {
		return err
	}
	return checkVersion(header(HeaderVersion))
}

// check checks a hop addressed to this node whose body has the sum; record remembers its
// nonce (a check that records nothing still refuses one seen).
func (a *Auth) check(in Inbound, sum Sum, record bool) error {
	self := a.self
	if len(a.keys) == 0 {
		return nil
	}
	fail := func(why string) error { return fmt.Errorf("%w: %s", ErrUnauthorized, why) }
	sig, err := hex.DecodeString(in.Header(HeaderSignature))
	if err != nil || len(sig) == 0 {
		return fail("no signature")
	}
	to, ts, nonce := in.Header(HeaderTo), in.Header(HeaderTime), in.Header(HeaderNonce)
	valid := false
	for _, k := range a.keys {
		valid = valid || hmac.Equal(sig, mac(k, in.Method, in.Path, in.Header(HeaderFrom), to, in.Header(HeaderVersion), ts, nonce, sum))
	}
	if !valid {
		return fail("bad signature")
	}
	if to != self {
		return fail(fmt.Sprintf("addressed to %q, this is %q", to, self))
	}
	ms, err := strconv.ParseInt(ts, 10, 64)
	now := a.now()
	if err != nil {
		return fail("bad timestamp")
	}
	if time.UnixMilli(ms).Before(a.started.Truncate(time.Millisecond)) {
		// It may have been seen, and answered, by this node's previous run.
		return fail("stamped before this node started")
	}
	if skew := now.Sub(time.UnixMilli(ms)).Abs(); skew > a.maxSkew {
		return fail(fmt.Sprintf("timestamp %v off this node's clock (more than %v)", skew.Round(time.Millisecond), a.maxSkew))
	}
	if len(nonce) != 32 {
		return fail("bad nonce")
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	for len(a.order) > 0 && now.After(a.seen[a.order[0]]) {
		delete(a.seen, a.order[0])
		a.order = a.order[1:]
	}
	if _, dup := a.seen[nonce]; dup {
		return fail("replayed nonce")
	}
	if !record {
		return nil
	}
	// A nonce must be remembered as long as its timestamp is acceptable: until ts+maxSkew.
	a.seen[nonce] = time.UnixMilli(ms).Add(a.maxSkew)
	a.order = append(a.order, nonce)
	return nil
}

// SignAnswer sets the signature of an answer from this node to asker's hop whose nonce was
// nonce, for a body of which the Sum is at hand: an answer a node acts on (a KV frame it
// installs) is bound to what it asked, so it can be neither forged nor swapped for the
// answer to another request. A BLAKE3 sum is also set in its header, which tells the
// asker which hash to check (a SHA-256 one is not: askers before 1.9 know no other).
func (a *Auth) SignAnswer(set func(name, value string), path, asker, nonce string, body Sum) {
	if body.BLAKE3 {
		set(HeaderBodyBLAKE3, body.Hex())
	}
	if len(a.keys) > 0 {
		set(HeaderSignature, hex.EncodeToString(answerMAC(a.keys[0], path, a.self, asker, nonce, body)))
	}
}

// VerifyAnswer checks the signature (header) of from's answer to this node's hop whose
// nonce was nonce, over its body.
func (a *Auth) VerifyAnswer(header func(string) string, path, from, nonce string, body []byte) error {
	return a.VerifyAnswerSum(header, path, from, nonce, SumOf(body, usesBLAKE3(header)))
}

// VerifyAnswerSum is VerifyAnswer for a body the caller hashed as it arrived (with
// HashFor and ReadHashing); sum is that body's.
func (a *Auth) VerifyAnswerSum(header func(string) string, path, from, nonce string, sum Sum) error {
	if len(a.keys) == 0 {
		return nil
	}
	sig, err := hex.DecodeString(header(HeaderSignature))
	if err != nil || len(sig) == 0 {
		return fmt.Errorf("%w: answer from %s not signed", ErrUnauthorized, from)
	}
	for _, k := range a.keys {
		if hmac.Equal(sig, answerMAC(k, path, from, a.self, nonce, sum)) {
			return nil
		}
	}
	return fmt.Errorf("%w: answer from %s: bad signature", ErrUnauthorized, from)
}

// answerMAC is the signature of an answer: its own label, so that no request's signature
// passes for an answer's.
func answerMAC(key []byte, path, from, to, nonce string, sum Sum) []byte {
	m := hmac.New(sha256.New, key)
	for _, part := range []string{"infernode-hop-answer", path, from, to, nonce, sum.signed()} {
		m.Write([]byte(part))
		m.Write([]byte{'\n'})
	}
	return m.Sum(nil)
}

package node

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"strings"
)

// idMinter makes and reads the ids of stored responses and their items. An id carries its
// conversation's key, less the principal (the API key and user that asked), and a MAC
// over the whole key: any node can route it to the conversation's owner, and only the
// principal that made it gets it back (to another, its MAC does not check out, so it is
// not found). Every node of a cluster derives the MAC's key from the cluster secret.
type idMinter struct{ key []byte }

// idNonce and idMAC are the bytes of an id's random part and of its MAC.
const (
	idNonce = 8
	idMAC   = 12
)

// defaultIDKey signs ids on nodes without a cluster secret (standalone or insecure),
// where conversation keys are namespaced by principal all the same.
var defaultIDKey = sha256.Sum256([]byte("infernode ids: no cluster secret"))

func newIDMinter(key []byte) idMinter {
	if len(key) == 0 {
		key = defaultIDKey[:]
	}
	return idMinter{key}
}

// mint returns a new id with prefix (resp, msg, fc) in convKey's conversation: prefix _
// base64url(kind, rest of the key, nonce, MAC).
func (m idMinter) mint(prefix, convKey string) string {
	kind, rest, ok := splitKey(convKey)
	if !ok {
		return prefix + "_" + randomID() // not a conversation key: an id nothing resolves
	}
	payload := make([]byte, 0, 1+len(rest)+idNonce+idMAC)
	payload = append(append(payload, kind), rest...)
	var nonce [idNonce]byte
	rand.Read(nonce[:])
	payload = append(payload, nonce[:]...)
	payload = append(payload, m.mac(prefix, convKey, nonce[:])...)
	return prefix + "_" + base64.RawURLEncoding.EncodeToString(payload)
}

// read returns id's prefix and its conversation's key, as principal asks for it; ok is
// false for an id this cluster did not issue to principal.
func (m idMinter) read(id, principal string) (prefix, convKey string, ok bool) {
	prefix, enc, found := strings.Cut(id, "_")
	if !found || len(enc) > 2*maxKeyLen {
		return "", "", false
	}
	payload, err := base64.RawURLEncoding.DecodeString(enc)
	if err != nil || len(payload) < 1+idNonce+idMAC {
		return "", "", false
	}
	mac := payload[len(payload)-idMAC:]
	nonce := payload[len(payload)-idMAC-idNonce : len(payload)-idMAC]
	convKey = string(payload[0]) + ":" + principal + ":" + string(payload[1:len(payload)-idMAC-idNonce])
	if !hmac.Equal(mac, m.mac(prefix, convKey, nonce)) {
		return "", "", false
	}
	return prefix, convKey, true
}

func (m idMinter) mac(prefix, convKey string, nonce []byte) []byte {
	h := hmac.New(sha256.New, m.key)
	h.Write([]byte(prefix))
	h.Write([]byte{0})
	h.Write([]byte(convKey))
	h.Write([]byte{0})
	h.Write(nonce)
	return h.Sum(nil)[:idMAC]
}

// splitKey splits a conversation key "k:principal:rest" (see sessionKey).
func splitKey(key string) (kind byte, rest string, ok bool) {
	if len(key) < 3 || key[1] != ':' {
		return 0, "", false
	}
	_, rest, ok = strings.Cut(key[2:], ":")
	return key[0], rest, ok
}

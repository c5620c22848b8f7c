package node

import (
	"crypto/sha256"
	"encoding/hex"
	"strconv"
	"unicode/utf8"

	"github.com/cespare/xxhash/v2"

	"github.com/infernode/infernode/session/infer"
)

// maxSessionIDLen bounds client-chosen conversation ids; maxKeyLen the keys made from them
// (a principal's namespace added).
const (
	maxSessionIDLen = 256
	maxKeyLen       = maxSessionIDLen + 32
)

// completionOpening is how much of a text completion's prompt names its conversation.
const completionOpening = 256

// principal names who is asking, for namespacing conversation keys: a hash of the API key
// presented and the request's user field. Two principals never share a conversation's
// slot, so neither can reuse (or time, or count) the other's cached tokens.
func principal(apiKey, user string) string {
	h := sha256.New()
	h.Write([]byte(apiKey))
	h.Write([]byte{0})
	h.Write([]byte(user))
	return hex.EncodeToString(h.Sum(nil)[:8])
}

// sessionKey names a request's conversation within its principal's namespace: the
// X-Session-ID header, else the body's session_id, else a hash of the conversation's
// opening (the model, the system prompt and the first user message), which every turn of
// one conversation repeats. Requests of one principal that share a long system prompt and
// first message land together too, which is what the KV cache wants.
func sessionKey(header, bodyID, model, principal string, opening []string) (string, error) {
	id := header
	if id == "" {
		id = bodyID
	}
	if id != "" {
		if len(id) > maxSessionIDLen {
			return "", badRequest("session_id", "session id is longer than %d bytes", maxSessionIDLen)
		}
		if !utf8.ValidString(id) {
			// It would cross the hop as U+FFFD (JSON), and the owner would compute
			// another conversation's key.
			return "", badRequest("session_id", "session id is not valid UTF-8")
		}
		return "s:" + principal + ":" + id, nil
	}
	h := xxhash.New()
	h.WriteString(model)
	for _, part := range opening {
		h.WriteString("\x00")
		h.WriteString(part)
	}
	return "h:" + principal + ":" + strconv.FormatUint(h.Sum64(), 16), nil
}

// chatOpening is the leading system messages and the first user message.
func chatOpening(msgs []infer.Message) []string {
	var out []string
	for _, m := range msgs {
		out = append(out, m.Role, m.Content)
		if m.Role == "user" {
			break
		}
	}
	return out
}

// promptOpening is the first bytes of a text prompt.
func promptOpening(prompt string) []string {
	if len(prompt) > completionOpening {
		prompt = prompt[:completionOpening]
	}
	return []string{prompt}
}

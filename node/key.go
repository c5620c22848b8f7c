package node

import (
	"strconv"

	"github.com/cespare/xxhash/v2"

	"github.com/infernode/infernode/session"
)

// maxSessionIDLen bounds client-chosen conversation ids.
const maxSessionIDLen = 256

// completionOpening is how much of a text completion's prompt names its conversation.
const completionOpening = 256

// sessionKey names a request's conversation: the X-Session-ID header, else the body's
// session_id, else a hash of the conversation's opening (the model, the system prompt and
// the first user message), which every turn of one conversation repeats. Requests that
// share a long system prompt and first message land together too, which is what the KV
// cache wants.
func sessionKey(header, bodyID, model string, opening []string) (string, error) {
	id := header
	if id == "" {
		id = bodyID
	}
	if id != "" {
		if len(id) > maxSessionIDLen {
			return "", badRequest("session_id", "session id is longer than %d bytes", maxSessionIDLen)
		}
		return id, nil
	}
	h := xxhash.New()
	h.WriteString(model)
	for _, part := range opening {
		h.WriteString("\x00")
		h.WriteString(part)
	}
	return "h:" + strconv.FormatUint(h.Sum64(), 16), nil
}

// chatOpening is the leading system messages and the first user message.
func chatOpening(msgs []session.Message) []string {
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

package session

import (
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"

	"github.com/cespare/xxhash/v2"

	"github.com/infernode/infernode/session/llama"
)

// Message is one turn of a chat.
type Message = llama.Message

// DefaultChatTemplate is the template used when the model declares none, or one llama.cpp
// does not recognise: ChatML (<|im_start|>role\ncontent<|im_end|>).
const DefaultChatTemplate = "chatml"

// ChatPrompt formats a conversation with the model's chat template (or
// DefaultChatTemplate) and opens the assistant's turn.
func (e *Engine) ChatPrompt(msgs []Message) (string, error) {
	tmpl := e.model.ChatTemplate()
	if tmpl != "" {
		p, err := llama.ApplyChatTemplate(tmpl, msgs, true)
		if err == nil {
			return p, nil
		}
		if !errors.Is(err, llama.ErrUnknownTemplate) {
			return "", fmt.Errorf("chat template: %w", err)
		}
	}
	return llama.ApplyChatTemplate(DefaultChatTemplate, msgs, true)
}

// Fingerprint identifies a model file and the engine settings that shape its KV cache:
// nodes serve one conversation interchangeably only when their fingerprints match. It
// hashes the whole file (xxhash: about a second for a few GB).
func Fingerprint(path, kvType string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", fmt.Errorf("fingerprint: %w", err)
	}
	defer f.Close()
	h := xxhash.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", fmt.Errorf("fingerprint %s: %w", path, err)
	}
	h.WriteString("\x00kv=" + kvType)
	return strconv.FormatUint(h.Sum64(), 16), nil
}

package session

import (
	"errors"
	"fmt"

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

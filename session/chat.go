package session

import (
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"

	"github.com/cespare/xxhash/v2"

	"github.com/infernode/infernode/session/infer"
	"github.com/infernode/infernode/session/llama"
)

// DefaultChatTemplate is the template used when the model declares none, or one llama.cpp
// does not recognise: ChatML (<|im_start|>role\ncontent<|im_end|>).
const DefaultChatTemplate = "chatml"

// contentMark delimits message content inside a formatted chat prompt (see
// infer.ContentMark).
const contentMark = infer.ContentMark

// ChatPrompt formats a conversation with the model's chat template (or
// DefaultChatTemplate) and opens the assistant's turn. Message contents are marked as
// data (see contentMark).
// Tokenize is text's tokens as the model reads it as data (control tokens spelled in it
// stay text), with the model's BOS first when addSpecial. Text longer in bytes than the
// longest prompt could spell is refused before it is tokenized.
func (e *Engine) Tokenize(text string, addSpecial bool) ([]int32, error) {
	if err := e.checkBytes(text); err != nil {
		return nil, err
	}
	return e.b.Tokenize(text, addSpecial, false)
}

// Detokenize is the text of tokens (control tokens render as nothing); an id outside the
// vocabulary is refused.
func (e *Engine) Detokenize(tokens []int32) (string, error) {
	var b strings.Builder
	for i, tok := range tokens {
		if tok < 0 || int(tok) >= e.b.NumVocab() {
			return "", &infer.InvalidError{Param: fmt.Sprintf("tokens[%d]", i), Reason: fmt.Sprintf("%d is not a token of the vocabulary (0 to %d)", tok, e.b.NumVocab()-1)}
		}
		b.Write(e.b.Piece(tok))
	}
	return b.String(), nil
}

func (e *Engine) ChatPrompt(msgs []infer.Message) (string, error) {
	lmsgs := make([]llama.Message, len(msgs))
	for i, m := range msgs {
		if strings.Contains(m.Content, contentMark) || strings.ContainsRune(m.Content, 0) {
			return "", &infer.InvalidError{Param: fmt.Sprintf("messages[%d].content", i), Reason: "must not contain NUL or U+FDD0"}
		}
		lmsgs[i] = llama.Message{Role: m.Role, Content: contentMark + m.Content + contentMark}
	}
	tmpl := e.b.ChatTemplate()
	if tmpl != "" {
		p, err := llama.ApplyChatTemplate(tmpl, lmsgs, true)
		if err == nil {
			return p, nil
		}
		if !errors.Is(err, llama.ErrUnknownTemplate) {
			return "", fmt.Errorf("chat template: %w", err)
		}
	}
	return llama.ApplyChatTemplate(DefaultChatTemplate, lmsgs, true)
}

// tokenize turns a prompt into tokens: the model's BOS where it wants one, control-token
// text parsed as control tokens outside content marks and never inside them.
func (e *Engine) tokenize(prompt string) ([]int32, error) {
	if !strings.Contains(prompt, contentMark) {
		return e.b.Tokenize(prompt, true, true)
	}
	parts := strings.Split(prompt, contentMark)
	// Tokenized whole, the prompt splits exactly as it would without marks. That is right
	// when its control tokens are the template's alone: when no content spells one.
	whole, err := e.b.Tokenize(strings.Join(parts, ""), true, true)
	if err != nil {
		return nil, err
	}
	want := e.controls(e.bos)
	for i := 0; i < len(parts); i += 2 {
		toks, err := e.b.Tokenize(parts[i], false, true)
		if err != nil {
			return nil, err
		}
		want += e.controls(toks)
	}
	if e.controls(whole) == want {
		return whole, nil
	}
	// Some content spells a control token: tokenize piece by piece, content as plain text.
	var out []int32
	for i, part := range parts {
		toks, err := e.b.Tokenize(part, i == 0, i%2 == 0)
		if err != nil {
			return nil, err
		}
		out = append(out, toks...)
	}
	return out, nil
}

// controls counts the control tokens in toks.
func (e *Engine) controls(toks []int32) int {
	n := 0
	for _, t := range toks {
		if e.b.IsControl(t) {
			n++
		}
	}
	return n
}

// Fingerprint identifies a model file and the engine settings that shape its KV cache
// (cfg's KV type and whether it uses flash attention): nodes serve one conversation
// interchangeably only when their fingerprints match. It hashes the whole file (xxhash:
// about a second for a few GB).
func Fingerprint(cfg Config) (string, error) {
	path := cfg.ModelPath
	f, err := os.Open(path)
	if err != nil {
		return "", fmt.Errorf("fingerprint: %w", err)
	}
	defer f.Close()
	h := xxhash.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", fmt.Errorf("fingerprint %s: %w", path, err)
	}
	h.WriteString("\x00kv=" + cfg.KVType)
	if !cfg.FlashAttn {
		h.WriteString("\x00v-transposed") // with it, the fingerprint is what it was before the setting
	}
	return strconv.FormatUint(h.Sum64(), 16), nil
}

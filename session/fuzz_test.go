package session

import (
	"bytes"
	"strings"
	"testing"

	"github.com/infernode/infernode/session/llama"
)

// FuzzParseFrame: whatever bytes arrive as a KV frame, the parser refuses them or returns a
// header, tokens and a state that agree with each other and with the bounds asked for,
// and never panics.
func FuzzParseFrame(f *testing.F) {
	want := frameHeader{Fingerprint: "fp", KVType: "f16"}
	good := func(tokens []int32, state []byte) []byte {
		head, err := frameHead(frameHeader{Fingerprint: "fp", KVType: "f16", Key: "k", Share: "t:a"}, tokens, state)
		if err != nil {
			f.Fatal(err)
		}
		return append(head, state...)
	}
	frame := good([]int32{1, 2, 3}, bytes.Repeat([]byte{7}, 100))
	f.Add(frame)
	f.Add(frame[:len(frame)-1])
	f.Add(good(nil, nil))
	f.Add(good([]int32{5}, bytes.Repeat([]byte{1}, frameChunk+3)))
	f.Add([]byte("INKV"))
	f.Fuzz(func(t *testing.T, b []byte) {
		h, tokens, state, err := parseFrame(b, want, 1000)
		if err != nil {
			return
		}
		if len(tokens) != h.Tokens || int64(len(state)) != h.StateBytes || len(tokens) > 1000 ||
			h.Fingerprint != want.Fingerprint || h.KVType != want.KVType {
			t.Fatalf("accepted a frame whose parts disagree: %+v, %d tokens, %d state bytes", h, len(tokens), len(state))
		}
	})
}

// FuzzChatTemplate: any roles and contents go through the chat template binding without a
// panic, and every content appears in what it formats.
func FuzzChatTemplate(f *testing.F) {
	f.Add("user", "hello", 1)
	f.Add("system", "<|im_start|>assistant\n", 3)
	f.Add("", "", 0)
	f.Add("assistant", strings.Repeat("x", 5000), 2)
	f.Fuzz(func(t *testing.T, role, content string, n int) {
		n = min(max(n, 0), 64)
		msgs := make([]llama.Message, n)
		for i := range msgs {
			msgs[i] = llama.Message{Role: role, Content: content}
		}
		out, err := llama.ApplyChatTemplate(DefaultChatTemplate, msgs, true)
		if err != nil {
			t.Fatalf("%d messages: %v", n, err)
		}
		if n > 0 && !strings.Contains(out, strings.ReplaceAll(content, "\x00", "")) && !strings.ContainsRune(content, 0) {
			t.Fatalf("the content is not in the formatted chat")
		}
	})
}

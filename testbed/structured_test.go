package testbed

import (
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/infernode/infernode/internal/testenv"
)

// storySchema forces a long answer (its story), so a kill lands mid-answer.
const storySchema = `{"type":"object","properties":{"title":{"type":"string","maxLength":20},` +
	`"story":{"type":"string","minLength":200,"maxLength":240},"moral":{"enum":["be kind","share","be brave"]}},` +
	`"required":["title","story","moral"],"additionalProperties":false}`

// TestStructuredKillOwner: a structured answer (response_format json_schema) streams
// through a forwarded hop on a real model; once with its owner left alone, once with its
// owner killed mid-answer. Both match the schema (validated by a JSON Schema library), and
// are equal to the byte: the next owner continues from the answer's own tokens, its
// grammar following them before it samples.
func TestStructuredKillOwner(t *testing.T) {
	model := testenv.SharedModel(t, "stories260K.gguf")
	c := launch(t, Config{Model: model, Nodes: 3, Args: []string{"--ctx", "8192"}})
	if _, err := c.WaitRings(t.Context(), c.IDs(), 30*time.Second); err != nil {
		t.Fatal(err)
	}
	entry, victim := c.Nodes[0], c.Nodes[1]
	var msgs []message
	for i := range 100 {
		m := []message{{"system", fmt.Sprintf("story %d", i)}, {"user", "Tell me a story."}}
		if chat(t, entry.URL(), m, 1).node == victim.ID {
			msgs = m
			break
		}
	}
	if msgs == nil {
		t.Fatal("no conversation of 100 is owned by node2")
	}
	req := func() map[string]any {
		return map[string]any{"messages": msgs, "max_tokens": 400, "temperature": 0,
			"response_format": map[string]any{"type": "json_schema", "json_schema": map[string]any{"name": "story", "strict": true, "schema": json.RawMessage(storySchema)}}}
	}
	reference, served, _, err := streamChatWith(entry.URL(), req(), 0, nil)
	if err != nil || served != victim.ID {
		t.Fatalf("uninterrupted: served by %s, %v", served, err)
	}
	testenv.ValidJSON(t, storySchema, reference)
	resumed, _, markers, err := streamChatWith(entry.URL(), req(), 60, victim.Kill)
	if err != nil || markers != 1 {
		t.Fatalf("killed mid-answer: %d resumes, %v", markers, err)
	}
	testenv.ValidJSON(t, storySchema, resumed)
	// Greedy, and continued from the answer's own tokens (not its text tokenized afresh,
	// which a grammar's choices split differently): the same answer to the byte.
	if resumed != reference {
		t.Errorf("the resumed answer differs from the uninterrupted one:\nresumed   %s\nreference %s", resumed, reference)
	}
	t.Logf("resumed after 60 events, %d bytes\n%s", len(resumed), resumed)
}

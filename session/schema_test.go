package session

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/infernode/infernode/internal/testenv"
	"github.com/infernode/infernode/session/infer"
)

// personSchema forces a long answer (its story), so a cut can land anywhere in it.
const personSchema = `{"type":"object","properties":{"name":{"type":"string","maxLength":12},` +
	`"age":{"type":"integer","minimum":1,"maximum":120},"pets":{"type":"array","items":{"enum":["cat","dog","bird"]},"maxItems":3},` +
	`"story":{"type":"string","minLength":120,"maxLength":160}},"required":["name","age","pets","story"],"additionalProperties":false}`

// TestSchema: on a real model that never saw JSON (stories260K), a response format's
// schema makes the answer match it, validated by a JSON Schema library; and an answer cut
// anywhere and resumed from its prompt and the text so far (as a resume on another owner
// does: Answered) still matches it as a whole. (It need not equal the uninterrupted one:
// the text so far is tokenized afresh, and on this vocabulary its tokens can differ from
// the ones generated, so the model's context differs; see docs/BENCHMARKS.md.)
func TestSchema(t *testing.T) {
	path := testenv.SharedModel(t, "stories260K.gguf")
	e := startEngine(t, func(c *Config) { c.ModelPath = path })
	const prompt = "Once upon a time, a girl"
	req := greedy("", prompt, 300)
	req.Schema = personSchema
	text, res := generate(t, e, req)
	if res.FinishReason != "stop" {
		t.Fatalf("finish reason %q after %d tokens: %q", res.FinishReason, res.CompletionTokens, text)
	}
	testenv.ValidJSON(t, personSchema, text)
	t.Logf("%d tokens: %s", res.CompletionTokens, text)

	unconstrained, _ := generate(t, e, greedy("", prompt, 40))
	if strings.HasPrefix(strings.TrimSpace(unconstrained), "{") {
		t.Errorf("without a schema the model wrote JSON too (%q): the test proves nothing", unconstrained)
	}

	for _, cut := range []int{1, len(text) / 3, len(text) * 2 / 3, len(text) - 2} {
		so := text[:cut]
		cont := greedy("", prompt+infer.ContentMark+so+infer.ContentMark, 300)
		cont.Schema, cont.Answered = personSchema, so
		rest, res := generate(t, e, cont)
		if res.FinishReason != "stop" {
			t.Errorf("resumed after %d bytes: finish reason %q", cut, res.FinishReason)
		}
		testenv.ValidJSON(t, personSchema, so+rest)
		t.Logf("resumed after %d bytes: equal to the uninterrupted answer: %v", cut, so+rest == text)
	}

	bad := greedy("", prompt, 10)
	bad.Schema = `{"type":"object"}`
	bad.Answered = `[1, 2`
	if _, err := e.Submit(t.Context(), bad); err == nil {
		t.Error("an answer so far that does not match the schema was taken")
	}
}

// BenchmarkSchema: what a response format's grammar costs a generated token: greedy
// answers of one prompt with and without personSchema. On stories260K (a real model, 512
// tokens) the model's choice mostly passes the grammar, so one token is checked; on
// INFERNODE_BENCH_MODEL, when set (random weights in SmolLM2-135M's shapes, 49k tokens),
// it rarely does, so the whole vocabulary is checked: the worst case.
func BenchmarkSchema(b *testing.B) {
	models := []string{testenv.SharedModel(b, "stories260K.gguf")}
	if m := os.Getenv("INFERNODE_BENCH_MODEL"); m != "" {
		models = append(models, m)
	}
	for _, model := range models {
		cfg := DefaultConfig()
		cfg.ModelPath, cfg.Cells, cfg.Seed = model, 4096, 1
		e := runEngine(b, cfg)
		for _, tc := range []struct{ name, schema string }{{"none", ""}, {"schema", personSchema}} {
			b.Run(strings.TrimSuffix(filepath.Base(model), ".gguf")+"/"+tc.name, func(b *testing.B) {
				tokens := 0
				for b.Loop() {
					req := greedy("", "Once upon a time, a girl", 150)
					req.Schema = tc.schema
					s, err := e.Submit(b.Context(), req)
					if err != nil {
						b.Fatal(err)
					}
					_, res, err := s.Collect()
					if err != nil {
						b.Fatal(err)
					}
					tokens += res.CompletionTokens
				}
				b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(tokens), "µs/token")
			})
		}
	}
}

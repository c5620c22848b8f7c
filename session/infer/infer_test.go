package infer

import (
	"errors"
	"testing"
)

func TestRequestValidate(t *testing.T) {
	good := Request{Prompt: "hi", Sampling: DefaultSampling()}
	tests := []struct {
		param string
		edit  func(r *Request)
	}{
		{"prompt", func(r *Request) { r.Prompt = "" }},
		{"max_tokens", func(r *Request) { r.MaxTokens = -1 }},
		{"temperature", func(r *Request) { r.Temperature = -0.1 }},
		{"temperature", func(r *Request) { r.Temperature = 2.5 }},
		{"top_p", func(r *Request) { r.TopP = 0 }},
		{"top_p", func(r *Request) { r.TopP = 1.01 }},
		{"top_k", func(r *Request) { r.TopK = -1 }},
		{"min_p", func(r *Request) { r.MinP = 2 }},
		{"presence_penalty", func(r *Request) { r.PresencePenalty = 3 }},
		{"frequency_penalty", func(r *Request) { r.FrequencyPenalty = -3 }},
		{"repeat_penalty", func(r *Request) { r.RepeatPenalty = -1 }},
		{"seed", func(r *Request) { r.Seed = 1 << 33 }},
		{"stop", func(r *Request) { r.Stop = []string{""} }},
		{"stop", func(r *Request) { r.Stop = make([]string, 17) }},
	}
	if err := good.Validate(); err != nil {
		t.Fatalf("Validate(good) = %v", err)
	}
	for _, tt := range tests {
		r := good
		tt.edit(&r)
		err := r.Validate()
		var ie *InvalidError
		if !errors.As(err, &ie) || ie.Param != tt.param {
			t.Errorf("Validate(bad %s) = %v, want an InvalidError for %s", tt.param, err, tt.param)
		}
	}
}

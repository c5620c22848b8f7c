package testbed

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"
)

// The reference: an unfaulted node that answers every conversation greedily, so that each
// answer the cluster gave can be compared with the exact one (and a difference proven to
// be a near-tie of the model rather than lost or repeated text).

// refAnswer is the reference's greedy answer with, for every token it chose, its log
// probability and the likeliest alternatives.
type refAnswer struct {
	text   string
	tokens []refToken
}

type refToken struct {
	Token       string  `json:"token"`
	Logprob     float64 `json:"logprob"`
	TopLogprobs []struct {
		Token   string  `json:"token"`
		Logprob float64 `json:"logprob"`
	} `json:"top_logprobs"`
}

// referenceAnswer asks the reference for its answer and its log probabilities in one
// request: two requests can differ (the second finds the whole prompt cached and computes
// its last tokens differently), and at an exact tie, so can their choices.
func referenceAnswer(ctx context.Context, client *http.Client, ref *Node, msgs []message, maxTokens int) (refAnswer, error) {
	body, _ := json.Marshal(map[string]any{"messages": msgs, "max_tokens": maxTokens, "temperature": 0,
		"logprobs": true, "top_logprobs": 5})
	req, _ := http.NewRequestWithContext(ctx, "POST", ref.URL()+"/v1/chat/completions", bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return refAnswer{}, err
	}
	defer resp.Body.Close()
	var out struct {
		Choices []struct {
			Message  message `json:"message"`
			Logprobs struct {
				Content []refToken `json:"content"`
			} `json:"logprobs"`
		} `json:"choices"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil || resp.StatusCode != http.StatusOK || len(out.Choices) == 0 {
		return refAnswer{}, fmt.Errorf("no answer with logprobs (%d, %v)", resp.StatusCode, err)
	}
	return refAnswer{text: out.Choices[0].Message.Content, tokens: out.Choices[0].Logprobs.Content}, nil
}

// tieAt checks that text left the reference's answer at byte d by taking an alternative
// nearly as likely as the reference's choice. It returns the gap, and why it is not a
// near-tie ("" when it is).
func (a refAnswer) tieAt(text string, d int, bound float64) (float64, string) {
	// The answer may have left the reference's tokens before its bytes differ: two
	// segmentations can spell the same text ("They" or "The"+"y"), and after such a flip
	// the model's next choices differ for real. So every token up to the first differing
	// byte is a candidate: one whose alternative the answer's text also continues with.
	best, found := 0.0, false
	offset := 0
	var near []string // the reference's tokens up to the difference, with their alternatives
	for _, tok := range a.tokens {
		if offset > d || offset > len(text) {
			break
		}
		alts := make([]string, len(tok.TopLogprobs))
		for i, alt := range tok.TopLogprobs {
			alts[i] = fmt.Sprintf("%q %.3g", alt.Token, alt.Logprob)
			if alt.Token == "" || alt.Token == tok.Token || !strings.HasPrefix(text[offset:], alt.Token) {
				continue
			}
			// Measured from the token chosen, which at an exact tie need not be listed first.
			if gap := max(0, tok.Logprob-alt.Logprob); !found || gap < best {
				best, found = gap, true
			}
		}
		near = append(near, fmt.Sprintf("%d %q [%s]", offset, tok.Token, strings.Join(alts, ", ")))
		offset += len(tok.Token)
	}
	switch {
	case !found:
		return 0, fmt.Sprintf("up to the difference, the answer never took one of the reference's 5 likeliest alternatives; "+
			"the reference's last tokens (byte offset, token, alternatives): %s", strings.Join(near[max(0, len(near)-3):], "; "))
	case best > bound:
		return best, fmt.Sprintf("the closest alternative it could have taken was %.3g below the reference's choice (near-tie here: %g)", best, bound)
	}
	return best, ""
}

// startReference runs a standalone node (no cluster) on loopback with cfg's binary (the
// one an upgrade installs, if any: an upgrade must not change an answer) and model, for
// reference answers.
func startReference(ctx context.Context, cfg Config) (*Node, func(), error) {
	bin := cfg.Binary
	if cfg.Upgrade != "" {
		bin = cfg.Upgrade
	}
	ref := &Node{ID: "reference", standalone: true, binary: bin, cfg: &Config{LogDir: cfg.LogDir},
		args: append([]string{"--model", cfg.Model, "--id", "reference", "--log-format", "json", "--addr", "127.0.0.1:0",
			"--threads", "1", "--ctx", "8192"}, cfg.Engine...)}
	if err := ref.start(ctx); err != nil {
		return nil, nil, err
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := http.Get(ref.URL() + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				break
			}
		}
		if time.Now().After(deadline) {
			ref.Kill()
			return nil, nil, errors.New("the reference node did not get ready in 30s")
		}
		time.Sleep(20 * time.Millisecond)
	}
	return ref, ref.Kill, nil
}

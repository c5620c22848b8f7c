package session

import (
	"cmp"
	"context"
	"encoding/binary"
	"slices"

	"github.com/cespare/xxhash/v2"
	"github.com/infernode/infernode/session/infer"
)

// Prefix digests: what a node tells its peers about the prompt beginnings it holds, so
// that a conversation's owner elsewhere can pull a shared beginning (a system prompt, a
// document) instead of prefilling it again (routing's prefix.go). A beginning is named
// by chained hashes of its whole blocks of infer.PrefixBlock tokens: the i-th hash covers
// the model's fingerprint, the sharing domain (infer.Request.Share: only a conversation of
// the same domain may use the cells) and every token of blocks 0 to i, so equal hashes
// mean equal beginnings (but for a 64-bit collision, which costs a prefill elsewhere,
// never a wrong answer: a pull carries the tokens themselves).

// Prefixes are the hashes of the blocks the sequences here hold, the most recently used
// sequence's first, each sequence's in order, each hash once, at most limit.
func (e *Engine) Prefixes(ctx context.Context, limit int) ([]uint64, error) {
	type held struct {
		share  string
		tokens []int32
		used   uint64
	}
	var all []held
	err := e.do(ctx, func() {
		for _, s := range e.slots {
			if len(s.tokens) >= infer.PrefixBlock {
				all = append(all, held{s.share, slices.Clone(s.tokens), s.lastUsed})
			}
		}
	})
	if err != nil {
		return nil, err
	}
	slices.SortFunc(all, func(a, b held) int { return cmp.Compare(b.used, a.used) })
	seen := map[uint64]bool{}
	var out []uint64
	for _, h := range all {
		for _, x := range e.prefixHashes(h.share, h.tokens) {
			if len(out) == limit {
				return out, nil
			}
			if !seen[x] {
				seen[x] = true
				out = append(out, x)
			}
		}
	}
	return out, nil
}

// PromptPrefixes is req's prompt as the engine reads it (see Submit) and the hashes of
// its blocks, its last token left out (it is always decoded again, so no cell of it is
// ever reused): what a peer's Prefixes lists for as long a beginning as it holds.
func (e *Engine) PromptPrefixes(req infer.Request) ([]int32, []uint64, error) {
	if err := e.checkBytes(req.Prompt); err != nil {
		return nil, nil, err
	}
	prompt, err := e.promptTokens(req)
	if err != nil {
		return nil, nil, err
	}
	prompt = append(prompt, req.Continue...)
	return prompt, e.prefixHashes(req.Share, prompt[:max(0, len(prompt)-1)]), nil
}

// prefixHashes are the chained hashes of tokens' whole blocks in domain share.
func (e *Engine) prefixHashes(share string, tokens []int32) []uint64 {
	h := xxhash.New()
	h.WriteString(e.cfg.Fingerprint)
	h.Write([]byte{0})
	h.WriteString(share)
	h.Write([]byte{0})
	out := make([]uint64, 0, len(tokens)/infer.PrefixBlock)
	var buf [4 * infer.PrefixBlock]byte
	for len(tokens) >= infer.PrefixBlock {
		for i, t := range tokens[:infer.PrefixBlock] {
			binary.LittleEndian.PutUint32(buf[4*i:], uint32(t))
		}
		h.Write(buf[:])
		out = append(out, h.Sum64())
		tokens = tokens[infer.PrefixBlock:]
	}
	return out
}

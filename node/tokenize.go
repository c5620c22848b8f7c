package node

import (
	"github.com/valyala/fasthttp"
)

// The tokenizer, for clients that count or build prompts in tokens (an evaluation harness
// needs no tokenizer download): POST /tokenize and POST /detokenize, in the shape
// llama.cpp's server and vLLM use. Only this node's model: a model only peers serve is
// tokenized by one of them.

type tokenizeRequest struct {
	Model      string  `json:"model"`
	Content    *string `json:"content"` // llama.cpp's name
	Prompt     *string `json:"prompt"`  // vLLM's
	AddSpecial bool    `json:"add_special"`
}

type tokenizeResponse struct {
	Tokens      []int32 `json:"tokens"`
	Count       int     `json:"count"`
	MaxModelLen int     `json:"max_model_len"`
}

type detokenizeRequest struct {
	Model  string  `json:"model"`
	Tokens []int32 `json:"tokens"`
}

func (s *Server) handleTokenize(ctx *fasthttp.RequestCtx) {
	var r tokenizeRequest
	if err := s.decodeTokenizer(ctx, &r, &r.Model); err != nil {
		writeError(ctx, err)
		return
	}
	text := r.Content
	if text == nil {
		text = r.Prompt
	}
	if text == nil {
		writeError(ctx, badRequest("content", "content (or prompt) is required"))
		return
	}
	tokens, err := s.engine.Tokenize(*text, r.AddSpecial)
	if err != nil {
		writeError(ctx, err)
		return
	}
	if tokens == nil {
		tokens = []int32{}
	}
	writeJSON(ctx, fasthttp.StatusOK, tokenizeResponse{Tokens: tokens, Count: len(tokens), MaxModelLen: s.engine.SeqCells()})
}

func (s *Server) handleDetokenize(ctx *fasthttp.RequestCtx) {
	var r detokenizeRequest
	if err := s.decodeTokenizer(ctx, &r, &r.Model); err != nil {
		writeError(ctx, err)
		return
	}
	text, err := s.engine.Detokenize(r.Tokens)
	if err != nil {
		writeError(ctx, err)
		return
	}
	writeJSON(ctx, fasthttp.StatusOK, map[string]string{"content": text})
}

// decodeTokenizer reads a tokenizer request into v and checks its model (*model, read
// from v): this node's, or none.
func (s *Server) decodeTokenizer(ctx *fasthttp.RequestCtx, v any, model *string) error {
	if !jsonContentType(ctx.Request.Header.ContentType()) {
		return errContentType
	}
	if err := decodeJSON(ctx.PostBody(), v); err != nil {
		return err
	}
	if ok, _ := s.ready(); !ok {
		return errNotReady
	}
	if *model != "" && *model != s.cfg.ModelName {
		return badRequest("model", "this node tokenizes for %s only: send the request to a node that serves %s", s.cfg.ModelName, *model)
	}
	return nil
}

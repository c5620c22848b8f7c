package session

import (
	"encoding/binary"
	"encoding/json"
	"fmt"

	"github.com/cespare/xxhash/v2"
	"github.com/infernode/infernode/session/infer"
)

// A KV frame carries one conversation's cache between engines of the same model and KV
// layout. It is self-describing and versioned, and checked piece by piece:
//
//	"INKV"                     magic
//	uint16                     format version (frameVersion)
//	uint32                     header length, then the header: JSON of frameHeader
//	int32 x header.Tokens      the conversation's token ids
//	uint64                     xxhash64 of the header and the token ids
//	uint64 x chunks            xxhash64 of each frameChunk bytes of the state (the last
//	                           chunk may be shorter)
//	header.StateBytes bytes    llama.cpp's sequence state
//
// Integers are little-endian. The state comes last and whole, so a receiver holding the
// frame installs the state where it lies, without a copy (version 1 interleaved chunk
// headers with the state). A reader refuses a frame of another version, model fingerprint
// or KV type before looking at its state, and a truncated frame or a bad checksum at the
// chunk where it shows.
const (
	frameMagic   = "INKV"
	frameVersion = 2
	frameChunk   = 1 << 20 // state bytes a checksum covers
	maxHeader    = 64 << 10
)

type frameHeader struct {
	Fingerprint string `json:"fingerprint"` // model file and KV type (see Fingerprint)
	KVType      string `json:"kv_type"`
	Key         string `json:"key"`             // the conversation
	Share       string `json:"share,omitempty"` // its prefix-sharing domain (see infer.Request.Share)
	Tokens      int    `json:"tokens"`          // token ids that follow the header
	StateBytes  int64  `json:"state_bytes"`     // llama.cpp's sequence state, at the end
}

// chunks is how many checksums a state of n bytes has.
func chunks(n int64) int64 { return (n + frameChunk - 1) / frameChunk }

// frameHead is a frame up to its state: magic, version, header, tokens, checksums.
func frameHead(h frameHeader, tokens []int32, state []byte) ([]byte, error) {
	h.Tokens, h.StateBytes = len(tokens), int64(len(state))
	hj, err := json.Marshal(h)
	if err != nil {
		return nil, err
	}
	head := make([]byte, 0, 10+len(hj)+4*len(tokens)+8+8*int(chunks(h.StateBytes)))
	head = binary.LittleEndian.AppendUint16(append(head, frameMagic...), frameVersion)
	head = binary.LittleEndian.AppendUint32(head, uint32(len(hj)))
	head = append(head, hj...)
	for _, t := range tokens {
		head = binary.LittleEndian.AppendUint32(head, uint32(t))
	}
	sum := xxhash.New()
	sum.Write(head[10:]) // the header and the token ids
	head = binary.LittleEndian.AppendUint64(head, sum.Sum64())
	for off := 0; off < len(state); off += frameChunk {
		head = binary.LittleEndian.AppendUint64(head, xxhash.Sum64(state[off:min(off+frameChunk, len(state))]))
	}
	return head, nil
}

// maxTokenState bounds a frame's state: a megabyte a token is more than the KV of any
// model llama.cpp runs on a CPU (a 70B model's is about 320 KB at f16).
const maxTokenState = 1 << 20

// parseFrame checks a frame held in memory and returns its header, tokens and state; the
// state is a slice of frame, not a copy. It refuses one not made for want (fingerprint and
// KV type), with more tokens than maxTokens, or with an implausibly large state, before
// looking at its state; then it checks every chunk of the state.
func parseFrame(frame []byte, want frameHeader, maxTokens int) (frameHeader, []int32, []byte, error) {
	var h frameHeader
	bad := func(format string, args ...any) (frameHeader, []int32, []byte, error) {
		return h, nil, nil, fmt.Errorf("%w: %s", infer.ErrFrame, fmt.Sprintf(format, args...))
	}
	b := frame
	take := func(n int) ([]byte, bool) {
		if n < 0 || n > len(b) {
			return nil, false
		}
		out := b[:n]
		b = b[n:]
		return out, true
	}
	pre, ok := take(10)
	switch {
	case !ok:
		return bad("truncated in its start (%d bytes)", len(frame))
	case string(pre[:4]) != frameMagic:
		return bad("not a KV frame")
	}
	if v := binary.LittleEndian.Uint16(pre[4:6]); v != frameVersion {
		return bad("format version %d, this node reads %d", v, frameVersion)
	}
	n := binary.LittleEndian.Uint32(pre[6:10])
	if n > maxHeader {
		return bad("header of %d bytes", n)
	}
	hj, ok := take(int(n))
	if !ok {
		return bad("truncated header")
	}
	if err := json.Unmarshal(hj, &h); err != nil {
		return bad("header: %v", err)
	}
	switch {
	case h.Fingerprint != want.Fingerprint:
		return bad("model fingerprint %q, this node serves %q", h.Fingerprint, want.Fingerprint)
	case h.KVType != want.KVType:
		return bad("KV type %q, this node uses %q", h.KVType, want.KVType)
	case h.Tokens < 1 || h.Tokens > maxTokens:
		return bad("%d tokens, this node holds 1 to %d a conversation", h.Tokens, maxTokens)
	case h.StateBytes < 1 || h.StateBytes > int64(h.Tokens+1)*maxTokenState:
		return bad("a state of %d bytes for %d tokens", h.StateBytes, h.Tokens)
	}
	toks, ok := take(4 * h.Tokens)
	if !ok {
		return bad("truncated tokens")
	}
	sumb, ok := take(8)
	if !ok {
		return bad("truncated header checksum")
	}
	sum := xxhash.New()
	sum.Write(hj)
	sum.Write(toks)
	if binary.LittleEndian.Uint64(sumb) != sum.Sum64() {
		return bad("header checksum mismatch")
	}
	table, ok := take(8 * int(chunks(h.StateBytes)))
	if !ok {
		return bad("truncated checksum table")
	}
	state := b
	if int64(len(state)) != h.StateBytes {
		return bad("a state of %d bytes, its header says %d", len(state), h.StateBytes)
	}
	for i, off := 0, 0; off < len(state); i, off = i+1, off+frameChunk {
		if xxhash.Sum64(state[off:min(off+frameChunk, len(state))]) != binary.LittleEndian.Uint64(table[8*i:]) {
			return bad("checksum mismatch in chunk %d", i)
		}
	}
	tokens := make([]int32, h.Tokens)
	for i := range tokens {
		tokens[i] = int32(binary.LittleEndian.Uint32(toks[4*i:]))
	}
	return h, tokens, state, nil
}

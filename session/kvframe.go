package session

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"slices"

	"github.com/cespare/xxhash/v2"
)

// A KV frame carries one conversation's cache between engines of the same model and KV
// layout. It is self-describing and versioned, and checked piece by piece:
//
//	"INKV"                     magic
//	uint16                     format version (frameVersion)
//	uint32                     header length, then the header: JSON of frameHeader
//	int32 x header.Tokens      the conversation's token ids
//	uint64                     xxhash64 of the header and the token ids
//	chunks                     uint32 length, uint64 xxhash64 of the data, the data;
//	                           until header.StateBytes bytes have come
//
// Integers are little-endian. A reader refuses a frame of another version, model
// fingerprint or KV type before reading its state, and a truncated frame or a bad checksum
// at the chunk where it shows.
const (
	frameMagic   = "INKV"
	frameVersion = 1
	frameChunk   = 1 << 20 // state bytes a chunk carries at most
	maxHeader    = 64 << 10
)

type frameHeader struct {
	Fingerprint string `json:"fingerprint"` // model file and KV type (see Fingerprint)
	KVType      string `json:"kv_type"`
	Key         string `json:"key"`         // the conversation
	Tokens      int    `json:"tokens"`      // token ids that follow the header
	StateBytes  int64  `json:"state_bytes"` // llama.cpp's sequence state, in chunks
}

// writeFrame writes a frame for a conversation's tokens and state.
func writeFrame(w io.Writer, h frameHeader, tokens []int32, state []byte) error {
	h.Tokens, h.StateBytes = len(tokens), int64(len(state))
	hj, err := json.Marshal(h)
	if err != nil {
		return err
	}
	bw := bufio.NewWriterSize(w, 64<<10)
	sum := xxhash.New()
	head := binary.LittleEndian.AppendUint16([]byte(frameMagic), frameVersion)
	head = binary.LittleEndian.AppendUint32(head, uint32(len(hj)))
	head = append(head, hj...)
	toks := make([]byte, 0, 4*len(tokens))
	for _, t := range tokens {
		toks = binary.LittleEndian.AppendUint32(toks, uint32(t))
	}
	sum.Write(hj)
	sum.Write(toks)
	bw.Write(head)
	bw.Write(toks)
	bw.Write(binary.LittleEndian.AppendUint64(nil, sum.Sum64()))
	for off := 0; off < len(state); off += frameChunk {
		chunk := state[off:min(off+frameChunk, len(state))]
		var ch [12]byte
		binary.LittleEndian.PutUint32(ch[:4], uint32(len(chunk)))
		binary.LittleEndian.PutUint64(ch[4:], xxhash.Sum64(chunk))
		bw.Write(ch[:])
		if _, err := bw.Write(chunk); err != nil {
			return err
		}
	}
	return bw.Flush()
}

// maxTokenState bounds a frame's state: a megabyte a token is more than the KV of any
// model llama.cpp runs on a CPU (a 70B model's is about 320 KB at f16).
const maxTokenState = 1 << 20

// readFrame reads and checks a frame. It refuses one not made for want (fingerprint and
// KV type), with more tokens than maxTokens, or with an implausibly large state, before
// reading its state; then it reads the state into buf (grown if need be), checking every
// chunk.
func readFrame(r io.Reader, want frameHeader, maxTokens int, buf []byte) (frameHeader, []int32, []byte, error) {
	var h frameHeader
	bad := func(format string, args ...any) (frameHeader, []int32, []byte, error) {
		return h, nil, nil, fmt.Errorf("%w: %s", ErrFrame, fmt.Sprintf(format, args...))
	}
	br := bufio.NewReaderSize(r, 64<<10)
	var pre [10]byte
	if _, err := io.ReadFull(br, pre[:]); err != nil {
		return bad("reading its start: %v", err)
	}
	if string(pre[:4]) != frameMagic {
		return bad("not a KV frame")
	}
	if v := binary.LittleEndian.Uint16(pre[4:6]); v != frameVersion {
		return bad("format version %d, this node reads %d", v, frameVersion)
	}
	n := binary.LittleEndian.Uint32(pre[6:10])
	if n > maxHeader {
		return bad("header of %d bytes", n)
	}
	hj := make([]byte, n)
	if _, err := io.ReadFull(br, hj); err != nil {
		return bad("truncated header: %v", err)
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
	toks := make([]byte, 4*h.Tokens)
	var sumb [8]byte
	if _, err := io.ReadFull(br, toks); err != nil {
		return bad("truncated tokens: %v", err)
	}
	if _, err := io.ReadFull(br, sumb[:]); err != nil {
		return bad("truncated header checksum: %v", err)
	}
	sum := xxhash.New()
	sum.Write(hj)
	sum.Write(toks)
	if binary.LittleEndian.Uint64(sumb[:]) != sum.Sum64() {
		return bad("header checksum mismatch")
	}
	tokens := make([]int32, h.Tokens)
	for i := range tokens {
		tokens[i] = int32(binary.LittleEndian.Uint32(toks[4*i:]))
	}
	state := slices.Grow(buf[:0], int(h.StateBytes))[:h.StateBytes]
	for off, i := 0, 0; off < len(state); i++ {
		var ch [12]byte
		if _, err := io.ReadFull(br, ch[:]); err != nil {
			return bad("truncated at chunk %d: %v", i, err)
		}
		size := int(binary.LittleEndian.Uint32(ch[:4]))
		if size < 1 || size > frameChunk || size > len(state)-off {
			return bad("chunk %d of %d bytes at offset %d of %d", i, size, off, len(state))
		}
		chunk := state[off : off+size]
		if _, err := io.ReadFull(br, chunk); err != nil {
			return bad("truncated in chunk %d: %v", i, err)
		}
		if xxhash.Sum64(chunk) != binary.LittleEndian.Uint64(ch[4:]) {
			return bad("checksum mismatch in chunk %d", i)
		}
		off += size
	}
	return h, tokens, state, nil
}

// Package infer holds the plain types of a generation: Request, Sampling, Result, Stats,
// Message, the Stream role and the sentinel errors. It has no cgo and no I/O, so the
// packages above the engine (routing, the HTTP front end) compile and test without
// llama.cpp. The engine itself is package session.
package infer

package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strings"

	"github.com/infernode/infernode/session/llama"
)

// quantize writes a GGUF model's weights in another type with llama.cpp's quantizer: a
// node serves the result like any model (every node of a ring must serve the same file).
func quantize(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("infernode quantize", flag.ContinueOnError)
	fs.SetOutput(stderr)
	types := strings.Join(llama.QuantTypes(), ", ")
	kind := fs.String("type", "q4_k_m", "weight type: "+types)
	threads := fs.Int("threads", runtime.NumCPU(), "threads")
	fs.Usage = func() {
		fmt.Fprint(stderr, "Usage: infernode quantize [--type T] IN.gguf OUT.gguf\n\n"+
			"Writes IN's weights as type T (llama.cpp's quantizer; 1-D tensors stay F32).\n\n")
		fs.PrintDefaults()
	}
	var files []string // flags may come before, between or after the two files
	for {
		if err := fs.Parse(args); err != nil {
			if err == flag.ErrHelp {
				return 0
			}
			return 2
		}
		if fs.NArg() == 0 {
			break
		}
		files, args = append(files, fs.Arg(0)), fs.Args()[1:]
	}
	if len(files) != 2 {
		fs.Usage()
		return 2
	}
	in, out := files[0], files[1]
	fail := func(err error) int {
		fmt.Fprintf(stderr, "infernode quantize: %v\n", err)
		if errors.Is(err, llama.ErrQuantType) {
			return 2
		}
		return 1
	}
	if _, err := os.Stat(in); err != nil {
		return fail(err)
	}
	// Written beside out and renamed, so a reader never sees half a model.
	tmp, err := os.CreateTemp(filepath.Dir(out), ".quantize-*.gguf")
	if err != nil {
		return fail(err)
	}
	tmp.Close()
	defer os.Remove(tmp.Name())
	if err := llama.Quantize(in, tmp.Name(), *kind, *threads); err != nil {
		return fail(err)
	}
	if err := os.Chmod(tmp.Name(), 0o644); err != nil {
		return fail(err)
	}
	if err := os.Rename(tmp.Name(), out); err != nil {
		return fail(err)
	}
	before, _ := os.Stat(in)
	after, _ := os.Stat(out)
	fmt.Fprintf(stdout, "wrote %s (%s, %.1f MB from %.1f MB)\n", out, strings.ToLower(*kind), float64(after.Size())/1e6, float64(before.Size())/1e6)
	return 0
}

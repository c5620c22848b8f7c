// Package testenv finds what tests need from their environment (the default test model,
// the real models in ../shared/models, root for network namespaces) and decides what a
// test does without it: skip with the reason on a developer's machine, fail under CI
// (CI set), so a CI that lost something never silently runs less.
package testenv

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/santhosh-tekuri/jsonschema/v6"
)

// Require skips t, or fails it when CI is set, unless ok. what says what is missing and
// how to get it.
func Require(t testing.TB, ok bool, what string) {
	t.Helper()
	if ok {
		return
	}
	if os.Getenv("CI") != "" {
		t.Fatalf("CI: %s", what)
	}
	t.Skip(what)
}

// Model is the default test model (INFERNODE_TEST_MODEL, which make test sets).
func Model(t testing.TB) string {
	t.Helper()
	path := os.Getenv("INFERNODE_TEST_MODEL")
	Require(t, path != "", "INFERNODE_TEST_MODEL not set; run through make test")
	return path
}

// SharedModel is the path of a real pretrained model in ../shared/models (next to the
// project's root): stories260K.gguf or tinystories-656k-f32.gguf.
func SharedModel(t testing.TB, name string) string {
	t.Helper()
	path := sharedModel(name)
	Require(t, path != "", "the real model "+name+" is not in ../shared/models (beside the project's root)")
	return path
}

func sharedModel(name string) string {
	dir, err := os.Getwd()
	if err != nil {
		return ""
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			path := filepath.Join(dir, "..", "shared", "models", name)
			if _, err := os.Stat(path); err == nil {
				return path
			}
			return ""
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return ""
		}
		dir = parent
	}
}

// Stories260KOnceUponATime is the greedy continuation of "Once upon a time" by
// stories260K.gguf for 60 tokens, as llama2.c documents it (../shared/models/README.md).
const Stories260KOnceUponATime = ", there was a little girl named Lily. She loved to play outside in the park. One day, she saw a big, red ball. She wanted to play with it, but it was too high.\nLily"

// RunWithBinary builds the infernode command (pkg, a path go build takes, relative to the
// test's package) into a temporary directory, sets *binary to it, runs the tests and
// exits with their code; INFERNODE_BINARY, when set, names a binary to use instead. A
// test package's TestMain calls it.
func RunWithBinary(m *testing.M, pkg string, binary *string) {
	if b := os.Getenv("INFERNODE_BINARY"); b != "" {
		*binary = b // built elsewhere (make chaos-mutants builds broken ones)
		os.Exit(m.Run())
	}
	dir, err := os.MkdirTemp("", "infernode-test-bin")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	*binary = filepath.Join(dir, "infernode")
	if out, err := exec.Command("go", "build", "-o", *binary, pkg).CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "build infernode: %v\n%s", err, out)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// ValidJSON fails t unless text is JSON that schema (a JSON schema) accepts, validated by
// a JSON Schema library (santhosh-tekuri/jsonschema), not by infernode's own code.
func ValidJSON(t testing.TB, schema, text string) {
	t.Helper()
	doc, err := jsonschema.UnmarshalJSON(strings.NewReader(schema))
	if err != nil {
		t.Fatalf("the schema: %v", err)
	}
	c := jsonschema.NewCompiler()
	if err := c.AddResource("schema.json", doc); err != nil {
		t.Fatal(err)
	}
	sch, err := c.Compile("schema.json")
	if err != nil {
		t.Fatalf("compile the schema: %v", err)
	}
	inst, err := jsonschema.UnmarshalJSON(strings.NewReader(text))
	if err != nil {
		t.Errorf("not JSON: %v\n%s", err, text)
		return
	}
	if err := sch.Validate(inst); err != nil {
		t.Errorf("does not match the schema: %v\n%s", err, text)
	}
}

#!/bin/sh
# build-at COMMIT OUT [PATCH]: build cmd/infernode from COMMIT's tree, with PATCH applied if
# given, into OUT (absolute paths). The tree links this one's .build (the headers cgo finds
# there, make deps), so the compiled llama.cpp is reused when its go.mod names the same
# ollama version. Run through make, whose environment has the cgo flags.
set -eu
commit=$1 out=$2 patch=${3:-}
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
git archive "$commit" | tar -x -C "$src"
ln -s "$(pwd)/.build" "$src/.build"
if [ -n "$patch" ]; then (cd "$src" && git apply "$patch"); fi
(cd "$src" && ${GO:-go} build -o "$out" ./cmd/infernode)

#!/bin/sh
# build-at COMMIT OUT [PATCH]: build cmd/infernode from COMMIT's tree, with PATCH applied if
# given, into OUT (absolute paths). The tree links this one's .build (the headers cgo finds
# there, make deps), so the compiled llama.cpp is reused when its go.mod names the same
# ollama version. Run through make, whose environment has the cgo flags and GOFLAGS naming
# this tree's patched go.mod: COMMIT's tree builds with it when its go.mod and llama.cpp
# patch are this tree's, and with the stock module otherwise (as it was built then).
set -eu
commit=$1 out=$2 patch=${3:-}
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
git archive "$commit" | tar -x -C "$src"
ln -s "$(pwd)/.build" "$src/.build"
if [ -n "$patch" ]; then (cd "$src" && git apply "$patch"); fi
plain=$(echo " ${GOFLAGS:-} " | sed 's/ -modfile=[^ ]*//g; s/^ *//; s/ *$//') # GOFLAGS without a -modfile
if ! cmp -s go.mod "$src/go.mod" || ! cmp -s scripts/ggml-fattn-skip.patch "$src/scripts/ggml-fattn-skip.patch"; then
	echo "build-at: $commit builds with the stock ollama module (its go.mod or llama.cpp patch differs)"
	export GOFLAGS="$plain"
elif [ -f .build/go.patched.mod ]; then
	# The copy by its real path, not through the tree's link: cgo's cache is keyed by the
	# package's folder, so the compiled llama.cpp is this tree's.
	sed "s|=> ./.build/ollama-patched|=> $(pwd)/.build/ollama-patched|" .build/go.patched.mod >"$src/go.patched.mod"
	cp .build/go.patched.sum "$src/go.patched.sum"
	export GOFLAGS="$plain -modfile=$src/go.patched.mod"
fi
(cd "$src" && ${GO:-go} build -o "$out" ./cmd/infernode)

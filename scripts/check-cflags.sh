#!/bin/sh
# check-cflags.sh fails early, with a message saying what to do, when the cgo compiler
# flags would compile ggml sources that ollama's llama package cannot link: AMX kernels
# (ggml-cpu/amx/*.cpp, a folder without a Go file, so cgo never compiles it).
set -eu
cc=${CC:-gcc}
flags="${CGO_CXXFLAGS:-} ${CGO_CFLAGS:-}"
# shellcheck disable=SC2086
if echo | $cc $flags -dM -E -x c++ - 2>/dev/null | grep -q '__AMX_INT8__'; then
	cat >&2 <<MSG
infernode: the compiler flags enable Intel AMX (__AMX_INT8__), but ollama's llama package
does not compile ggml's AMX sources, so every binary would fail to link with
"undefined reference to ggml_backend_amx_buffer_type()".
Add -mno-amx-tile -mno-amx-int8 -mno-amx-bf16 to CGO_CFLAGS and CGO_CXXFLAGS
(the Makefile does this; flags now: $flags).
MSG
	exit 1
fi

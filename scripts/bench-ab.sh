#!/bin/sh
# bench-ab.sh BASE_BIN HEAD_BIN MODEL PAIRS: make bench-http's load (loadgen at 1, 4 and 8
# streams, 5 rounds of 64 tokens) against one node of each binary in turn, PAIRS times,
# base first in odd pairs and head first in even ones, so drift in the machine's speed
# falls on both. Prints one line a run: pair, binary, concurrency, decode tok/s, TTFT p50,
# ITL p99.
set -eu
base=$1 head=$2 model=$3 pairs=${4:-4}
port=${PORT:-18091}
loadgen=${LOADGEN:-bin/loadgen}
run() { # binary label pair
	"$1" --model "$model" --addr 127.0.0.1:$port --seed 1 --log-level warn &
	pid=$!
	until curl -sf 127.0.0.1:$port/readyz >/dev/null; do kill -0 $pid || exit 1; sleep 0.2; done
	$loadgen --url http://127.0.0.1:$port --concurrency ${CONC:-1,4,8} --rounds 5 --max-tokens 64 --json |
		python3 -c 'import json,sys
for l in json.load(sys.stdin):
    print(sys.argv[1], sys.argv[2], l["concurrency"], round(l["decode_tok_s"],1), round(l["ttft_p50_ms"],1), round(l["itl_p99_ms"],2))' "$3" "$2"
	kill $pid; wait $pid 2>/dev/null || true
}
for i in $(seq 1 "$pairs"); do
	if [ $((i % 2)) = 1 ]; then run "$base" base $i; run "$head" head $i; else run "$head" head $i; run "$base" base $i; fi
done

#!/usr/bin/env bash
# Client libraries no one here wrote, unchanged, against a 3-node cluster of the real
# binary: the Vercel AI SDK (its default OpenAI provider calls the Responses API), the
# official OpenAI SDK and LangChain (scripts/clients/check.mjs says what each check does).
# Needs node and npm (the packages are installed from the npm registry, pinned).
# Usage: scripts/check-clients.sh BIN MODEL
set -euo pipefail
bin=$1 model=$2
dir=$(cd "$(dirname "$0")/clients" && pwd)
if [ ! -f "$model" ]; then
	echo "check-clients: skipped: no model at $model (the real models live in ../shared/models)"
	exit 0
fi
if ! command -v npm >/dev/null; then
	echo "check-clients: node and npm are needed (apt-get install nodejs npm)" >&2
	exit 2
fi
if [ ! -d "$dir/node_modules" ] || [ "$dir/package.json" -nt "$dir/node_modules" ]; then
	(cd "$dir" && npm install --no-audit --no-fund --silent && touch node_modules)
fi
log=$(mktemp -d)
"$bin/testbed" run --binary "$bin/infernode" --model "$model" --nodes 3 --http-port 18181 --gossip-port 18947 --log-dir "$log" >"$log/run.out" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do
	grep -q "nodes up" "$log/run.out" && break
	kill -0 $pid 2>/dev/null || { cat "$log/run.out"; exit 1; }
	sleep 0.1
done
grep -q "nodes up" "$log/run.out" || { echo "check-clients: the cluster did not come up" >&2; cat "$log/run.out"; exit 1; }
MODEL=$(basename "$model" .gguf) node "$dir/check.mjs" http://127.0.0.1:18181 http://127.0.0.1:18182 http://127.0.0.1:18183 2> >(grep -v -e 'AI SDK Warning' -e trace-warnings >&2)

#!/bin/sh
# chaos-mutants: for each patch in testbed/mutants (one KV path or fault handling broken on
# purpose), build infernode from the committed tree (HEAD) with the patch applied and run
# the short chaos suite against that binary (-failfast: it stops at the first scenario
# that fails). Each
# mutant must fail it; the table says where, and which invariants caught it. Logs go to
# MUTANTS_OUT (default: a temporary directory, removed). Run through make, whose
# environment has the cgo flags.
set -eu
GO=${GO:-go}
root=$(pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
out=${MUTANTS_OUT:-$tmp/out}
mkdir -p "$out"
table="$out/table.md"
printf '| mutant | short suite | caught by |\n| --- | --- | --- |\n' >"$table"
status=0
for p in testbed/mutants/*.patch; do
	name=$(basename "$p" .patch)
	sh scripts/build-at.sh HEAD "$tmp/infernode-$name" "$root/$p"
	echo "== $name"
	start=$(date +%s)
	rc=0
	INFERNODE_BINARY="$tmp/infernode-$name" $GO test -count=1 -failfast -timeout 20m -run '^TestChaosShort$' -v ./testbed >"$out/$name.log" 2>&1 || rc=$?
	took=$(($(date +%s) - start))
	caught=$(grep -o 'invariant "[^"]*" failed' "$out/$name.log" | sort -u | sed 's/^invariant //; s/ failed$//' | paste -sd ';' - | sed 's/;/; /g')
	where=$(grep -o -- '--- FAIL: TestChaosShort/[a-z-]*' "$out/$name.log" | sed 's|.*/||' | paste -sd ',' -)
	if grep -q -- '--- SKIP: TestChaosShort' "$out/$name.log"; then
		verdict="skipped (no shared model?)"
		status=1
	elif [ "$rc" -eq 0 ]; then
		verdict="PASSED: not caught"
		status=1
	else
		verdict="fails in ${where:-?} (${took}s)"
	fi
	printf '| %s | %s | %s |\n' "$name" "$verdict" "$caught" >>"$table"
	tail -n 1 "$table"
done
cat "$table"
exit $status

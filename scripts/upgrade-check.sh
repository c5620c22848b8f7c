#!/bin/sh
# upgrade-check [COMMIT]: build infernode at COMMIT (default: the newest commit whose hop
# minor version differs from this tree's) and run testbed's TestUpgrade, which starts a
# cluster on that binary and replaces its nodes one by one with this tree's under chat load.
# Run through make, whose environment has the cgo flags: the earlier tree then reuses the
# compiled llama.cpp when its go.mod names the same ollama version.
set -eu
GO=${GO:-go}
# minor COMMIT: the hop minor version at COMMIT (none: in the working tree).
minor() { git grep -h -E '^[[:space:]]+Minor[[:space:]]*=[[:space:]]*[0-9]+' ${1:-} -- node | head -1 | tr -dc 0-9; }
from=${1:-}
if [ -z "$from" ]; then
	now=$(minor)
	for c in $(git rev-list HEAD); do
		if [ "$(minor "$c")" != "$now" ]; then from=$c; break; fi
	done
	[ -n "$from" ] || { echo "upgrade-check: no commit with another hop minor version than 1.$now"; exit 1; }
fi
from=$(git rev-parse --short "$from")
echo "upgrade-check: from $from (hop 1.$(minor "$from")) to this tree (hop 1.$(minor))"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
sh scripts/build-at.sh "$from" "$tmp/infernode-$from"
INFERNODE_UPGRADE_FROM="$tmp/infernode-$from" $GO test -count=1 -timeout 10m -run '^TestUpgrade$' -v ./testbed

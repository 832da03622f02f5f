#!/usr/bin/env bash
# A/B of alloc_patterns builds on the CPU side alone: each round runs every build once, in turn, on
# one pinned CPU, with the simulated device (no driver calls, no CUDA start-up), and keeps each
# build's per-operation time of one pattern; prints per build the median, the quartiles and the
# median of its per-round ratio to the first build. Rounds a few tenths of a second apart see the
# same state of a shared host, so the per-round ratio compares like with like.
#
#   CPU=3 ROUNDS=30 PATTERN=mixed BINS="A/alloc_patterns B/alloc_patterns" bash ab.sh
#
# PATTERN: mixed (one row) or hot_pair (its 512-byte row). Each build is labelled by its folder.
set -uo pipefail
BINS=${BINS:?BINS: alloc_patterns binaries, the first one the baseline}
CPU=${CPU:-3}
ROUNDS=${ROUNDS:-30}
PATTERN=${PATTERN:-mixed}
dir=$(mktemp -d)
for r in $(seq "$ROUNDS"); do
  for b in $BINS; do
    label=$(basename "$(dirname "$b")")
    ns=$(taskset -c "$CPU" "$b" --sim --only "$PATTERN" | awk -F, -v p="$PATTERN" '$1 == p { print $4; exit }')
    # A round without a figure from every build would pair the rounds wrongly: stop instead.
    [ -n "$ns" ] || { echo "ab.sh: $b printed no $PATTERN row in round $r" >&2; rm -rf "$dir"; exit 1; }
    echo "$ns" >> "$dir/$label"
  done
done
python3 - "$dir" "$PATTERN" "$CPU" $BINS <<'PY'
import os, statistics as st, sys
d, pattern, cpu, bins = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
labels = [os.path.basename(os.path.dirname(b)) for b in bins]
runs = {l: [float(x) for x in open(f"{d}/{l}")] for l in labels}
base = runs[labels[0]]
print(f"== {pattern} on CPU {cpu}, {len(base)} rounds: build | ns median (quartiles) | per-round ratio to {labels[0]}: median (quartiles)")
for l in labels:
    q = st.quantiles(runs[l], n=4)
    r = [a / b for a, b in zip(runs[l], base)]
    rq = st.quantiles(r, n=4)
    print(f"{l} | {st.median(runs[l]):.1f} ({q[0]:.1f}-{q[2]:.1f}) | {st.median(r):.3f} ({rq[0]:.3f}-{rq[2]:.3f})")
PY
rm -rf "$dir"

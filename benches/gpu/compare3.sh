#!/usr/bin/env bash
# RUNS interleaved runs of PyTorch's harness (the anchor), `alloc_patterns` and
# `alloc_patterns --raw`; per row the per-run ratios PyTorch / tensormem, their median, the ratio of the
# medians, and the 8-thread row's throughput against one thread's.
#
#   ANCHORS=DIR BIN=PATH/alloc_patterns bash compare3.sh
#
# ANCHORS: a copy of benches/anchors (torch_alloc_bench.cpp, build_torch_bench.sh); BIN: the binary
# to measure; RUNS (3); PIN: a prefix for every run, e.g. "taskset -c 5"; TAG: the results' folder
# under $OUT (or /tmp).
set -uo pipefail
ANCHORS=${ANCHORS:?ANCHORS: a copy of benches/anchors}
BIN=${BIN:?BIN: the alloc_patterns binary}
RUNS=${RUNS:-3}
PIN=${PIN:-}
TAG=${TAG:-compare3}
dir=${OUT:-/tmp}/$TAG
mkdir -p "$dir"
[ -x /tmp/torch_bench ] || bash "$ANCHORS/build_torch_bench.sh" /tmp/torch_bench >/dev/null
for r in $(seq "$RUNS"); do
  $PIN /tmp/torch_bench > "$dir/torch_$r.csv"
  $PIN "$BIN" > "$dir/proj_$r.csv"
  $PIN "$BIN" --raw > "$dir/raw_$r.csv"
done
python3 - "$dir" "$RUNS" "$TAG" <<'PY'
import csv, sys, statistics as st
d, n, tag = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def load(p, backend=None):
    return {(r["pattern"], r["size_or_window"]): float(r["ns_per_op"])
            for r in csv.DictReader(open(p)) if backend is None or r["backend"] == backend}
T = [load(f"{d}/torch_{i}.csv", "torch_caching") for i in range(1, n + 1)]
P = [load(f"{d}/proj_{i}.csv") for i in range(1, n + 1)]
R = [load(f"{d}/raw_{i}.csv") for i in range(1, n + 1)]
fmt = lambda xs, f: " / ".join(f.format(x) for x in xs)
print(f"== {tag}: row | PyTorch runs | tensormem runs | ratio per run | median ratio | ratio of medians | --raw runs")
for k in (k for k in P[0] if k[0] != "mt_hot_pair_1MiB"):
    t, p, r = [x[k] for x in T], [x[k] for x in P], [x.get(k, float("nan")) for x in R]
    ratios = [a / b for a, b in zip(t, p)]
    print(f"{k[0]} {k[1]} | {fmt(t, '{:.1f}')} | {fmt(p, '{:.1f}')} | {fmt(ratios, '{:.2f}')} | "
          f"{st.median(ratios):.2f}x | {st.median(t) / st.median(p):.2f}x | {fmt(r, '{:.1f}')}")
one = [x[("mt_hot_pair_1MiB", "1 threads")] for x in P]
eight = [x[("mt_hot_pair_1MiB", "8 threads")] for x in P]
scaling = [8 * a / b for a, b in zip(one, eight)]
print(f"8 threads vs 1 (throughput) | 1: {fmt(one, '{:.1f}')}; 8: {fmt(eight, '{:.1f}')} | "
      f"{fmt(scaling, '{:.2f}')} | {st.median(scaling):.2f}x")
PY

#!/usr/bin/env bash
# Paired runs: PyTorch's caching-allocator rows and each alloc_patterns build alternated on one pinned
# CPU, PAIRS times, so that the two runs of a pair (a second or two apart) see the same state of a
# shared host; per row the median, quartiles and range of the per-pair ratios PyTorch / tensormem.
#
#   ANCHORS=DIR CPU=3 PAIRS=12 BINS="A/alloc_patterns B/alloc_patterns" bash paired.sh
#
# PyTorch's side is the anchor harness cut to its torch_caching section: its own hot_pair_ns and
# mixed_op_ns, called in its order with its counts and seed, without its cudaMallocAsync, cudaMalloc
# and threaded rows (about a second instead of fifteen). The cut is made here, from the anchor's source,
# at run time. Each build is labelled by its folder's name.
set -uo pipefail
ANCHORS=${ANCHORS:?ANCHORS: a copy of benches/anchors}
BINS=${BINS:?BINS: alloc_patterns binaries}
CPU=${CPU:-3}
PAIRS=${PAIRS:-12}
dir=${OUT:-/tmp}/paired_cpu$CPU
mkdir -p "$dir"
if [ ! -x /tmp/torch_caching_only ]; then
  python3 - "$ANCHORS/torch_alloc_bench.cpp" /tmp/torch_caching_only.cpp <<'PY'
import sys
src = open(sys.argv[1]).read()
main = r'''int main() {
  c10::cuda::CUDACachingAllocator::init(c10::cuda::device_count());
  cudaStream_t s; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  Backend b = {"torch_caching", torch_alloc, torch_free};
  size_t sizes[] = {512, 65536, 1 << 20, 8 << 20, 64 << 20};
  printf("pattern,backend,size_or_window,ns_per_op\n");
  for (size_t sz : sizes) printf("hot_pair,%s,%zu,%.1f\n", b.name, sz, hot_pair_ns(b, sz, 200000, s));
  printf("mixed,%s,256,%.1f\n", b.name, mixed_op_ns(b, 200000, 256, 42, s));
  CK(cudaDeviceSynchronize());
  return 0;
}
'''
open(sys.argv[2], "w").write(src[:src.index("int main(")] + main)
PY
  TORCH=$(python3 -c 'import torch, os; print(os.path.dirname(torch.__file__))')
  nvcc -O2 -std=c++17 -x cu /tmp/torch_caching_only.cpp -o /tmp/torch_caching_only -diag-suppress 177 \
    -I"$TORCH/include" -L"$TORCH/lib" -lc10_cuda -lc10 -Xlinker -rpath -Xlinker "$TORCH/lib" \
    -D_GLIBCXX_USE_CXX11_ABI=$(python3 -c 'import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))')
fi
for i in $(seq "$PAIRS"); do
  taskset -c "$CPU" /tmp/torch_caching_only > "$dir/torch_$i.csv"
  for b in $BINS; do
    taskset -c "$CPU" "$b" > "$dir/$(basename "$(dirname "$b")")_$i.csv"
  done
done
python3 - "$dir" "$PAIRS" $BINS <<'PY'
import csv, os, statistics as st, sys
d, n, bins = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
load = lambda p: {(r["pattern"], r["size_or_window"]): float(r["ns_per_op"]) for r in csv.DictReader(open(p))}
T = [load(f"{d}/torch_{i}.csv") for i in range(1, n + 1)]
for b in bins:
    label = os.path.basename(os.path.dirname(b))
    P = [load(f"{d}/{label}_{i}.csv") for i in range(1, n + 1)]
    print(f"== CPU {os.path.basename(d)[10:]} {label}: row | PyTorch median (range) | tensormem median (range) | "
          "per-pair ratio: median (quartiles; range)")
    for k in T[0]:
        t, p = [x[k] for x in T], [x[k] for x in P]
        r = sorted(a / b for a, b in zip(t, p))
        q = st.quantiles(r, n=4)
        print(f"{k[0]} {k[1]} | {st.median(t):.1f} ({min(t):.0f}-{max(t):.0f}) | {st.median(p):.1f} "
              f"({min(p):.1f}-{max(p):.1f}) | {st.median(r):.2f}x ({q[0]:.2f}-{q[2]:.2f}; {r[0]:.2f}-{r[-1]:.2f})")
PY

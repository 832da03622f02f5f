"""Pools the runs of several `compare3.sh` calls: per row, the per-run ratios PyTorch / tensormem of
every call together, with their median, quartiles and range, and each call's own median.

    python3 benches/gpu/pool_runs.py RESULTS/n1 RESULTS/n2 ...

Each folder is one call's `$OUT/$TAG` (torch_N.csv, proj_N.csv for N = 1, 2, ...). A shared host
gives each run its own draw of the CPU's state, so one call's median moves with the draw; the pooled
median over several calls is the steadier reading of the same runs.
"""
import csv
import os
import statistics as st
import sys


def load(path, backend=None):
    return {(r["pattern"], r["size_or_window"]): float(r["ns_per_op"])
            for r in csv.DictReader(open(path))
            if backend is None or r["backend"] == backend}


def runs_of(folder):
    n = 1
    while os.path.exists(f"{folder}/proj_{n}.csv"):
        yield load(f"{folder}/torch_{n}.csv", "torch_caching"), load(f"{folder}/proj_{n}.csv")
        n += 1


def main():
    folders = sys.argv[1:]
    if not folders:
        raise SystemExit(__doc__)
    ratios, per_call, scaling = {}, {}, []
    for folder in folders:
        call = {}
        for torch, proj in runs_of(folder):
            for key, ns in proj.items():
                if key[0] == "mt_hot_pair_1MiB":
                    continue
                ratios.setdefault(key, []).append(torch[key] / ns)
                call.setdefault(key, []).append(torch[key] / ns)
            one = proj[("mt_hot_pair_1MiB", "1 threads")]
            eight = proj[("mt_hot_pair_1MiB", "8 threads")]
            scaling.append(8 * one / eight)
        for key, values in call.items():
            per_call.setdefault(key, []).append(st.median(values))
    print(f"== {len(folders)} calls: row | runs | median (quartiles; range) | each call's median")
    for key, values in ratios.items():
        q = st.quantiles(values, n=4)
        calls = " / ".join(f"{m:.2f}" for m in per_call[key])
        print(f"{key[0]} {key[1]} | {len(values)} | {st.median(values):.2f}x "
              f"({q[0]:.2f}-{q[2]:.2f}; {min(values):.2f}-{max(values):.2f}) | {calls}")
    q = st.quantiles(scaling, n=4)
    print(f"8 threads vs 1 (throughput) | {len(scaling)} | {st.median(scaling):.2f}x "
          f"({q[0]:.2f}-{q[2]:.2f}; {min(scaling):.2f}-{max(scaling):.2f})")


if __name__ == "__main__":
    main()

"""Benchmark: PyTorch on its native allocator vs on tensormem's, in one call on one machine.

    python3 step_bench.py [--lib PATH/libtensormem_torch.so] [--steps 12] [--rounds 2]

Each round runs, in fresh processes, native then tensormem: gpt2_train steps (median of the steps after
the first two) and the small-ops eager loop (median of 5 runs of 2000 iterations). Prints CSV rows
`step_bench,BACKEND,METRIC,VALUE` as benches/anchors/torch_step_bench.py does, then the ratios
tensormem / native of the medians over rounds (below 1: tensormem faster).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# The scripts beside this one; in a checkout, the package in the crate's python/ (else the installed one).
PACKAGE_ROOT = os.path.normpath(os.path.join(HERE, "..", "..", "python"))
sys.path.insert(0, HERE)
if os.path.isdir(os.path.join(PACKAGE_ROOT, "tensormem_torch")):
    sys.path.insert(1, PACKAGE_ROOT)


def child(backend, lib, steps):
    import torch
    plugin = None
    if backend == "tensormem":
        import tensormem_torch
        plugin = tensormem_torch.install(lib)
    import workloads
    losses, times = workloads.gpt2_train(steps=steps)
    small = [workloads.small_ops() for _ in range(5)]
    stats = plugin.stats() if plugin else torch.cuda.memory_stats()
    print("result," + json.dumps({
        "step_ms": statistics.median(times[2:]) * 1e3,
        "small_ops_us": statistics.median(small) * 1e6,
        "peak_reserved": stats["reserved_bytes.all.peak"],
        "losses": losses,
        "device": torch.cuda.get_device_name(), "torch": torch.__version__}), flush=True)


def run(backend, lib, steps):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", backend, "--steps", str(steps)]
    if lib:
        cmd += ["--lib", lib]
    out = subprocess.run(cmd, capture_output=True, text=True)
    rows = [line[7:] for line in out.stdout.splitlines() if line.startswith("result,")]
    if out.returncode != 0 or not rows:
        sys.stderr.write(out.stderr[-4000:])
        raise SystemExit(f"step_bench: the {backend} run failed (exit {out.returncode})")
    r = json.loads(rows[-1])
    print(f"step_bench,{backend},gpt2_train_step_ms_median,{r['step_ms']:.2f}")
    print(f"step_bench,{backend},gpt2_losses," + " ".join(f"{x:.6f}" for x in r["losses"]))
    print(f"step_bench,{backend},small_ops_us_per_iter_median,{r['small_ops_us']:.2f}")
    print(f"step_bench,{backend},peak_reserved_bytes,{r['peak_reserved']}", flush=True)
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.lib, args.steps)
        return
    results = {"native": [], "tensormem": []}
    for _ in range(args.rounds):
        for backend in ("native", "tensormem"):
            results[backend].append(run(backend, args.lib, args.steps))
    first = results["native"][0]
    print(f"step_bench,device,{first['device']},torch {first['torch']}")
    for metric in ("step_ms", "small_ops_us", "peak_reserved"):
        native = statistics.median(r[metric] for r in results["native"])
        ours = statistics.median(r[metric] for r in results["tensormem"])
        print(f"step_bench,ratio_tensormem_over_native,{metric},{ours / native:.3f}")


if __name__ == "__main__":
    main()

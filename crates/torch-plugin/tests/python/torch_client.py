"""Real-client check: runs a workload on PyTorch's native allocator and on tensormem's (each in its own
process, same seeds) and compares the losses; prints both peak reserved figures.

    python3 torch_client.py [--lib PATH/libtensormem_torch.so] [--rtol 1e-3] gpt2_train cudagraph_train mempool record_stream

Exits 0 if every workload ran to the end on both allocators with losses equal within --rtol (PyTorch's
backward is not bitwise deterministic: two native runs differ by about 1e-6 relative), 1 otherwise.
One JSON line per workload and allocator is printed (prefix "run,"), then one verdict line per workload.
`mempool` checks the other way of using the plugin: PyTorch's allocator stays current and one
torch.cuda.MemPool takes its segments from tensormem. `record_stream` checks, on both allocators, that
memory freed while a busy side stream still reads it (Tensor.record_stream) is not reused too early.
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# The scripts beside this one; in a checkout, the package in the crate's python/ (else the installed one).
PACKAGE_ROOT = os.path.normpath(os.path.join(HERE, "..", "..", "python"))
sys.path.insert(0, HERE)
if os.path.isdir(os.path.join(PACKAGE_ROOT, "tensormem_torch")):
    sys.path.insert(1, PACKAGE_ROOT)

WORKLOADS = ("gpt2_train", "cudagraph_train")
# Checks that are not loss comparisons: name -> the backends each runs on.
CHECKS = {"mempool": ("tensormem",), "record_stream": ("native", "tensormem")}


def mempool_check(lib):
    """PyTorch's allocator stays current; one torch.cuda.MemPool takes its segments from tensormem."""
    import torch
    import tensormem_torch
    plugin, pool = tensormem_torch.mem_pool(lib)
    n = 4 << 20
    with torch.cuda.use_mem_pool(pool):
        x = torch.ones(n, device="cuda")
        y = x * 2
    z = torch.ones(n, device="cuda")  # outside the pool: PyTorch's own memory
    total = (y.sum() + z.sum()).item()
    held = plugin.stats(torch.cuda.current_device())["allocated_bytes.all.current"]
    ok = total == 3 * n and held >= 2 * 4 * n
    print(f"{'PASS' if ok else 'FAIL'} mempool: sum {total} (want {3 * n}); tensormem holds {held} B for "
          f"the pool's segments (want >= {2 * 4 * n})", flush=True)
    del x, y, pool
    return ok


def record_stream_check(backend, lib):
    """Tensor.record_stream is honoured: memory freed while a busy side stream still reads it is not
    handed to the next allocation on the default stream before the side stream is done."""
    import torch
    if backend == "tensormem":
        import tensormem_torch
        tensormem_torch.install(lib)
    side = torch.cuda.Stream()
    n = 1 << 20
    wrong = 0
    for i in range(20):
        a = torch.full((n,), float(i), device="cuda")
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(5_000_000)  # the side stream reads `a` only a few ms from now
            b = a.clone()
        a.record_stream(side)
        del a
        c = torch.full((n,), -1.0, device="cuda")  # the size of `a`, on the default stream
        torch.cuda.current_stream().wait_stream(side)
        wrong += int((b != float(i)).sum().item())
        del b, c
    ok = wrong == 0
    print(f"{'PASS' if ok else 'FAIL'} record_stream on {backend}: {wrong} elements read after their "
          "memory was reused (want 0)", flush=True)
    return ok


def child(workload, backend, lib):
    """Runs one workload in this process on `backend` and prints its result as JSON."""
    import torch
    plugin = None
    if backend == "tensormem":
        import tensormem_torch
        plugin = tensormem_torch.install(lib)
    import workloads
    if workload == "gpt2_train":
        losses, _ = workloads.gpt2_train()
    else:
        losses = workloads.cudagraph_train()
    torch.cuda.synchronize()
    if plugin is None:
        stats = torch.cuda.memory_stats()
        hooks = []
    else:
        stats = plugin.stats()
        hooks = plugin.hooks
        err = plugin.last_error()
        if err:
            print(f"tensormem reported an error during the run: {err}", file=sys.stderr)
    print("run," + json.dumps({
        "workload": workload, "backend": backend, "losses": losses,
        "peak_reserved": stats["reserved_bytes.all.peak"],
        "peak_allocated": stats["allocated_bytes.all.peak"],
        "num_device_alloc": stats.get("num_device_alloc"), "hooks": hooks,
        "torch": torch.__version__, "device": torch.cuda.get_device_name()}), flush=True)


def run(workload, backend, lib):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", workload, backend]
    if lib:
        cmd += ["--lib", lib]
    out = subprocess.run(cmd, capture_output=True, text=True)
    sys.stderr.write(out.stderr[-4000:])
    rows = [line[4:] for line in out.stdout.splitlines() if line.startswith("run,")]
    if out.returncode != 0 or not rows:
        print(f"FAIL {workload} on {backend}: exit {out.returncode}\n{out.stdout[-2000:]}")
        return None
    print("run," + rows[-1])
    return json.loads(rows[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", help="libtensormem_torch.so (default: tensormem_torch.find_library())")
    ap.add_argument("--rtol", type=float, default=1e-3)
    ap.add_argument("--child", nargs=2, metavar=("WORKLOAD", "BACKEND"), help=argparse.SUPPRESS)
    ap.add_argument("workloads", nargs="*", default=list(WORKLOADS) + list(CHECKS))
    args = ap.parse_args()
    if args.child:
        if args.child[0] == "mempool":
            return 0 if mempool_check(args.lib) else 1
        if args.child[0] == "record_stream":
            return 0 if record_stream_check(args.child[1], args.lib) else 1
        child(args.child[0], args.child[1], args.lib)
        return 0
    ok = True
    for workload in args.workloads:
        if workload in CHECKS:
            for backend in CHECKS[workload]:
                cmd = [sys.executable, os.path.abspath(__file__), "--child", workload, backend]
                out = subprocess.run(cmd + (["--lib", args.lib] if args.lib else []), capture_output=True,
                                     text=True)
                print(out.stdout.strip())
                if out.returncode != 0:
                    sys.stderr.write(out.stderr[-4000:])
                    print(f"FAIL {workload} on {backend}: exit {out.returncode}")
                    ok = False
            continue
        if workload not in WORKLOADS:
            ap.error(f"unknown workload {workload}; one of {', '.join(list(WORKLOADS) + list(CHECKS))}")
        native = run(workload, "native", args.lib)
        ours = run(workload, "tensormem", args.lib)
        if native is None or ours is None:
            ok = False
            continue
        a, b = native["losses"], ours["losses"]
        worst = max((abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b)), default=float("inf"))
        same = len(a) == len(b) and len(a) > 0 and worst <= args.rtol
        ok &= same
        print(f"{'PASS' if same else 'FAIL'} {workload}: {len(b)} losses, largest relative difference "
              f"{worst:.2e} (rtol {args.rtol}); peak reserved native {native['peak_reserved']} B, "
              f"tensormem {ours['peak_reserved']} B (ratio {ours['peak_reserved'] / max(native['peak_reserved'], 1):.3f}); "
              f"hooks wired: {', '.join(ours['hooks']) or 'none'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

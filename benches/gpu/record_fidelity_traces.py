"""Records PyTorch allocator traces of the kinds replay must reproduce exactly: out-of-memory errors the
program catches, expandable segments inside private pools, Inductor's CUDA graph trees, private pools
created and destroyed while the program runs, programs that change the allocator while they run (the
memory fraction, the allocator settings), memory pools made with options the snapshot does not record
(no_split), and a few more (empty_cache between phases, record_stream across several streams, captures
sharing a pool).

Run on a GPU machine with PyTorch:

    python3 benches/gpu/record_fidelity_traces.py OUTDIR [NAME ...]

Every trace is recorded in a fresh Python process (allocator settings must be in place before the first
CUDA allocation, and the statistics must start at zero), with PYTORCH_CUDA_ALLOC_CONF set for it. Each
writes OUTDIR/NAME.pickle (torch.cuda.memory._dump_snapshot, history switched on before the first
allocation) and OUTDIR/NAME.stats.json (memory_stats() of device 0 at the top level, a "devices" map of
every device's, and the recording's settings). The whole set takes about two to three minutes on an H100
(the torch.compile traces take most of it); each child is stopped after CHILD_TIMEOUT seconds and the set
after TOTAL_BUDGET seconds, so it never runs past five minutes.
"""
import json
import os
import random
import subprocess
import sys
import time

CHILD_TIMEOUT = 100
TOTAL_BUDGET = 280
MIB = 1 << 20


# ---------------------------------------------------------------------------------------------------
# Workloads (run in the child process; torch imported there)


def _oom_loop(torch, seed, steps=200, max_mib=48, pool=None):
    """Random allocations of 1..max_mib MiB with random lifetimes; every OutOfMemoryError is caught
    and the live tensors dropped."""
    rng = random.Random(seed)
    live, ooms = [], 0
    for i in range(steps):
        size = rng.randint(1, max_mib) * MIB - rng.randint(0, 4095)
        try:
            if pool is not None and i % 3 == 0:
                with torch.cuda.use_mem_pool(pool):
                    live.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
            else:
                live.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError:
            ooms += 1
            live.clear()
        if len(live) > 12 or (live and rng.random() < 0.3):
            live.pop(rng.randrange(len(live)))
    torch.cuda.synchronize()
    return ooms


def oom_gc(torch):
    torch.cuda.set_per_process_memory_fraction(0.004)
    _oom_loop(torch, 21)


def oom_max_split(torch):
    torch.cuda.set_per_process_memory_fraction(0.005)
    _oom_loop(torch, 22, max_mib=64)


def oom_expandable(torch):
    torch.cuda.set_per_process_memory_fraction(0.004)
    _oom_loop(torch, 23)


def oom_mempool_use_on_oom(torch):
    torch.cuda.set_per_process_memory_fraction(0.004)
    pool = torch.cuda.MemPool(use_on_oom=True)
    keep = []
    with torch.cuda.use_mem_pool(pool):
        for _ in range(6):
            keep.append(torch.empty(8 * MIB, dtype=torch.uint8, device="cuda"))
    del keep
    _oom_loop(torch, 24, pool=pool)


def _mlp(torch, width=1024):
    return torch.nn.Sequential(
        torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
    ).cuda()


def graph_expandable(torch):
    """One training step captured with torch.cuda.graph (private pool) under expandable segments."""
    model = _mlp(torch)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(512, 1024, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(g):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
    for _ in range(5):
        x.copy_(torch.randn(512, 1024, device="cuda"))
        g.replay()
    torch.cuda.synchronize()
    del g, loss
    rng = random.Random(5)
    keep = []
    for _ in range(100):
        keep.append(torch.empty(rng.randint(1, 1 << 23), dtype=torch.uint8, device="cuda"))
        if len(keep) > 16:
            keep.pop(rng.randrange(len(keep)))
    torch.cuda.synchronize()


def mempool_expandable(torch):
    """A MemPool beside eager allocations under expandable segments, emptied and deleted at the end."""
    rng = random.Random(6)
    pool = torch.cuda.MemPool()
    eager, pooled = [], []
    for i in range(300):
        size = rng.randint(1, 1 << 23)
        if i % 3 == 0:
            with torch.cuda.use_mem_pool(pool):
                pooled.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
        else:
            eager.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
        if len(eager) > 16:
            eager.pop(rng.randrange(len(eager)))
        if len(pooled) > 8:
            pooled.pop(rng.randrange(len(pooled)))
    torch.cuda.synchronize()
    del pooled
    del pool
    torch.cuda.synchronize()


def _compile_train(torch, steps=8):
    """Training with the model compiled under reduce-overhead: forward and backward run as CUDA graph
    trees (their private pool), the loss and the optimizer step eager."""
    model = _mlp(torch, 512)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = torch.compile(model, mode="reduce-overhead")
    for i in range(steps):
        x = torch.randn(64 if i % 2 else 128, 512, device="cuda")
        torch.compiler.cudagraph_mark_step_begin()
        loss = compiled(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del loss
    torch.cuda.synchronize()


def compile_train_expandable(torch):
    _compile_train(torch)


def compile_train_ro(torch):
    _compile_train(torch)


def compile_ro_shapes(torch):
    """Inference with reduce-overhead over five batch sizes, each seen several times."""
    model = _mlp(torch, 768).eval()
    compiled = torch.compile(model, mode="reduce-overhead")
    rng = random.Random(9)
    with torch.no_grad():
        for _ in range(20):
            b = rng.choice([16, 32, 48, 64, 128])
            compiled(torch.randn(b, 768, device="cuda"))
    torch.cuda.synchronize()


def mempool_loop(torch):
    """A MemPool created, used and deleted in each of 6 rounds, beside eager allocations."""
    rng = random.Random(12)
    eager = []
    for r in range(6):
        pool = torch.cuda.MemPool()
        pooled = []
        for i in range(40):
            if i % 2:
                with torch.cuda.use_mem_pool(pool):
                    pooled.append(torch.empty(rng.randint(1, 1 << 23), dtype=torch.uint8, device="cuda"))
            else:
                eager.append(torch.empty(rng.randint(1, 1 << 23), dtype=torch.uint8, device="cuda"))
            if len(eager) > 12:
                eager.pop(rng.randrange(len(eager)))
            if len(pooled) > 6:
                pooled.pop(rng.randrange(len(pooled)))
        if r % 2:
            pooled.clear()
        del pooled
        del pool
    torch.cuda.synchronize()


def mempool_empty_cache(torch):
    """Two MemPools and eager work in three phases separated by torch.cuda.empty_cache(); one pool is
    deleted in the middle."""
    rng = random.Random(13)
    a, b = torch.cuda.MemPool(), torch.cuda.MemPool()
    eager, in_a, in_b = [], [], []
    for phase in range(3):
        for i in range(80):
            size = rng.randint(1, 1 << 23)
            which = i % 4
            if which == 0:
                with torch.cuda.use_mem_pool(a):
                    in_a.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
            elif which == 1 and b is not None:
                with torch.cuda.use_mem_pool(b):
                    in_b.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
            else:
                eager.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
            for lst in (eager, in_a, in_b):
                if len(lst) > 10:
                    lst.pop(rng.randrange(len(lst)))
        torch.cuda.synchronize()
        if phase == 1:
            in_b.clear()
            b = None
        eager.clear()
        torch.cuda.empty_cache()
    torch.cuda.synchronize()


def record_stream_multi(torch):
    """Blocks made on the default stream and used on three side streams (record_stream)."""
    rng = random.Random(14)
    streams = [torch.cuda.Stream() for _ in range(3)]
    live = []
    for i in range(240):
        t = torch.empty(rng.randint(1, 1 << 22), dtype=torch.uint8, device="cuda")
        s = streams[i % 3]
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            t.fill_(1)
        t.record_stream(s)
        live.append(t)
        if len(live) > 12:
            live.pop(rng.randrange(len(live)))
        if i % 60 == 59:
            torch.cuda.synchronize()
    torch.cuda.synchronize()


def graph_shared_pool(torch):
    """Two graphs captured into one pool (graph_pool_handle), capture_error_mode="thread_local", the
    first one reset before eager work goes on."""
    model = _mlp(torch, 512)
    x = torch.randn(256, 512, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            model(x)
    torch.cuda.current_stream().wait_stream(s)
    pool = torch.cuda.graph_pool_handle()
    g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g1, pool=pool, capture_error_mode="thread_local"):
        y1 = model(x)
    with torch.cuda.graph(g2, pool=pool, capture_error_mode="thread_local"):
        y2 = model(y1)
    for _ in range(3):
        g1.replay()
        g2.replay()
    torch.cuda.synchronize()
    g1.reset()
    del y1
    rng = random.Random(15)
    keep = []
    for _ in range(80):
        keep.append(torch.empty(rng.randint(1, 1 << 22), dtype=torch.uint8, device="cuda"))
        if len(keep) > 10:
            keep.pop(rng.randrange(len(keep)))
    torch.cuda.synchronize()
    del g2, y2


# name -> (workload, PYTORCH_CUDA_ALLOC_CONF)
def _set_settings(torch, text):
    """Changes the allocator settings mid-run the way PyTorch 2.11 asks programs to."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        torch.cuda.memory._set_allocator_settings(text)
    else:
        setter(text)


def _varied(torch, seed, steps=300):
    """Allocations of sizes rounding and splitting decide differently (small blocks, odd sizes of a
    few MiB, large multiples of 5 MiB, large blocks freed and asked for again in pieces), with
    random lifetimes."""
    rng = random.Random(seed)
    live = []
    for _ in range(steps):
        if len(live) > 12 or (live and rng.random() < 0.35):
            live.pop(rng.randrange(len(live)))
            continue
        kind = rng.randrange(4)
        if kind == 0:
            size = rng.randint(1, 900) * 1000
        elif kind == 1:
            size = rng.randint(1, 60) * MIB + 12_345
        elif kind == 2:
            size = rng.randint(1, 8) * 5 * MIB
        else:
            size = rng.randint(2, 200) * MIB
        live.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
    live.clear()
    torch.cuda.synchronize()


def fraction_changes(torch):
    """set_per_process_memory_fraction called three times: low (OOMs caught), higher, lower again."""
    torch.cuda.set_per_process_memory_fraction(0.004)
    _oom_loop(torch, 31, steps=120)
    torch.cuda.set_per_process_memory_fraction(0.02)
    _oom_loop(torch, 32, steps=120, max_mib=96)
    torch.cuda.set_per_process_memory_fraction(0.006)
    _oom_loop(torch, 33, steps=120)


def settings_changes(torch):
    """Rounding from PYTORCH_CUDA_ALLOC_CONF at start, then max_split_size_mb set mid-run (which also
    puts the rounding back to PyTorch's default)."""
    _varied(torch, 41)
    _set_settings(torch, "max_split_size_mb:64")
    _varied(torch, 42)


def settings_changes_split_back(torch):
    """max_split_size_mb from PYTORCH_CUDA_ALLOC_CONF at start, then rounding set mid-run."""
    _varied(torch, 43)
    _set_settings(torch, "roundup_power2_divisions:8")
    _varied(torch, 44)


def settings_changes_gc(torch):
    """Garbage collection under a memory fraction, its threshold raised mid-run; OOMs caught."""
    torch.cuda.set_per_process_memory_fraction(0.006)
    _oom_loop(torch, 45, steps=150)
    _set_settings(torch, "garbage_collection_threshold:0.9")
    _oom_loop(torch, 46, steps=150)


def mempool_no_split(torch):
    """A MemPool made with no_split=True used through use_mem_pool beside eager allocations of the
    same sizes: inside the pool every request takes a whole cached block."""
    pool = torch.cuda.MemPool(no_split=True)
    rng = random.Random(47)
    live = []
    for i in range(200):
        if len(live) > 10 or (live and rng.random() < 0.4):
            live.pop(rng.randrange(len(live)))
            continue
        size = rng.choice([rng.randint(1, 900) * 1000, rng.randint(1, 40) * MIB + 4321])
        if i % 2:
            with torch.cuda.use_mem_pool(pool):
                live.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
        else:
            live.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
    live.clear()
    torch.cuda.synchronize()
    del pool


WORKLOADS = {
    "oom_gc__fraction-0.004_garbage_collection_threshold-0.6": (oom_gc, "garbage_collection_threshold:0.6"),
    "oom_max_split__fraction-0.005_max_split_size_mb-32": (oom_max_split, "max_split_size_mb:32"),
    "oom_expandable__fraction-0.004_expandable_segments-True": (oom_expandable, "expandable_segments:True"),
    "oom_mempool_use_on_oom__fraction-0.004": (oom_mempool_use_on_oom, ""),
    "graph_expandable__expandable_segments-True": (graph_expandable, "expandable_segments:True"),
    "mempool_expandable__expandable_segments-True": (mempool_expandable, "expandable_segments:True"),
    "compile_train_ro__expandable_segments-True": (compile_train_expandable, "expandable_segments:True"),
    "compile_train_ro": (compile_train_ro, ""),
    "compile_ro_shapes": (compile_ro_shapes, ""),
    "mempool_loop": (mempool_loop, ""),
    "mempool_empty_cache": (mempool_empty_cache, ""),
    "record_stream_multi": (record_stream_multi, ""),
    "graph_shared_pool": (graph_shared_pool, ""),
    "fraction_changes": (fraction_changes, ""),
    "settings_changes__roundup_power2_divisions-4": (settings_changes, "roundup_power2_divisions:4"),
    "settings_changes__max_split_size_mb-100": (settings_changes_split_back, "max_split_size_mb:100"),
    "settings_changes_gc__garbage_collection_threshold-0.6": (settings_changes_gc, "garbage_collection_threshold:0.6"),
    "mempool_no_split": (mempool_no_split, ""),
}


def record_one(name, out):
    import torch

    workload, conf = WORKLOADS[name]
    torch.cuda.init()
    torch.cuda.memory._record_memory_history(
        enabled="all", context=None, stacks="python", max_entries=10_000_000
    )
    start = time.time()
    error = None
    try:
        workload(torch)
    except Exception as e:  # recorded as far as it went; the stats say what failed
        error = f"{type(e).__name__}: {e}"
    torch.cuda.memory._dump_snapshot(os.path.join(out, name + ".pickle"))
    torch.cuda.memory._record_memory_history(enabled=None)
    stats = dict(torch.cuda.memory_stats(0))
    stats["devices"] = {
        str(d): dict(torch.cuda.memory_stats(d)) for d in range(torch.cuda.device_count())
        if torch.cuda.memory_stats(d)
    }
    stats["wall_s"] = time.time() - start
    stats["torch"] = torch.__version__
    stats["device"] = torch.cuda.get_device_name()
    stats["device_total_bytes"] = torch.cuda.mem_get_info()[1]
    stats["alloc_conf"] = conf
    if error:
        stats["workload_error"] = error
    with open(os.path.join(out, name + ".stats.json"), "w") as f:
        json.dump(stats, f, indent=1, sort_keys=True)
    print(name, "ooms", stats.get("num_ooms"), "device allocs", stats.get("num_device_alloc"),
          "syncs", stats.get("num_sync_all_streams"), error or "", flush=True)


def main():
    if len(sys.argv) >= 4 and sys.argv[1] == "--one":
        record_one(sys.argv[2], sys.argv[3])
        return
    if len(sys.argv) < 2:
        sys.exit(f"usage: {sys.argv[0]} OUTDIR [NAME ...]   (names: {', '.join(WORKLOADS)})")
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    names = sys.argv[2:] or list(WORKLOADS)
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        sys.exit(f"unknown workloads: {unknown}")
    began = time.time()
    failed = []
    for name in names:
        left = TOTAL_BUDGET - (time.time() - began)
        if left < 10:
            failed.append((name, "skipped: out of time"))
            continue
        env = dict(os.environ)
        conf = WORKLOADS[name][1]
        if conf:
            env["PYTORCH_CUDA_ALLOC_CONF"] = conf
        else:
            env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        env.pop("PYTORCH_ALLOC_CONF", None)
        try:
            r = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--one", name, out],
                env=env, timeout=min(CHILD_TIMEOUT, left),
            )
            if r.returncode != 0:
                failed.append((name, f"exit status {r.returncode}"))
        except subprocess.TimeoutExpired:
            failed.append((name, "timed out"))
    print(f"recorded {len(names) - len(failed)} of {len(names)} traces into {out} in "
          f"{time.time() - began:.0f} s")
    for name, why in failed:
        print(f"  {name}: {why}")


if __name__ == "__main__":
    main()

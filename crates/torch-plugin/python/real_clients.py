"""Ordinary PyTorch programs on PyTorch's native allocator and on tensormem's, each in a fresh process.

    python3 real_clients.py [--lib PATH/libtensormem_torch.so] [--out results.json] [WORKLOAD ...]

Each workload is seeded and runs with deterministic algorithms; it prints one JSON line (prefix
"result,") with its outputs, peak reserved bytes and device allocations (from torch.cuda.memory_stats(),
which answers on either allocator). The driver runs each workload natively, then on tensormem
(tensormem_torch.install(mode="native")), and prints a verdict per workload: PASS when the outputs are
equal and, where the workload says they must be, peak reserved bytes and device allocations too.
Exits 1 if any workload fails. Workloads that need what this host lacks (two GPUs) print SKIP.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def setup(backend, lib):
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if backend == "tensormem":
        import tensormem_torch
        tensormem_torch.install(lib, mode="native")
    import torch
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    return torch


def figures(torch):
    torch.cuda.synchronize()
    s = torch.cuda.memory_stats()
    return {"peak_reserved": s["reserved_bytes.all.peak"], "device_allocs": s.get("num_device_alloc"),
            "allocator": torch.cuda.memory.get_allocator_backend()}


def cnn_amp(torch):
    import torchvision
    model = torchvision.models.resnet18(num_classes=10).cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    losses = []
    for _ in range(6):
        x = torch.randn(32, 3, 64, 64, device="cuda", generator=g).to(memory_format=torch.channels_last)
        y = torch.randint(0, 10, (32,), device="cuda", generator=g)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(round(loss.item(), 4))
    return {"out": losses, "strict": True}


def transformer_varlen(torch):
    from torch.utils.checkpoint import checkpoint
    layer = torch.nn.TransformerEncoderLayer(256, 8, 1024, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 4).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator(device="cuda").manual_seed(2)
    losses = []
    for length in (64, 200, 37, 512, 128, 300):
        x = torch.randn(8, length, 256, device="cuda", generator=g)
        h = x
        for block in model.layers:
            h = checkpoint(block, h, use_reentrant=False)
        loss = h.float().pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(round(loss.item(), 4))
    return {"out": losses, "strict": True}


def _mlp(torch):
    return torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512)).cuda()


def compile_infer(torch):
    model = _mlp(torch).eval()
    f = torch.compile(model, mode="reduce-overhead")
    g = torch.Generator(device="cuda").manual_seed(3)
    outs = []
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(64, 512, device="cuda", generator=g)
            outs.append(round(f(x).double().sum().item(), 3))
    return {"out": outs, "strict": False}


def compile_train(torch):
    model = _mlp(torch)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    f = torch.compile(model, mode="reduce-overhead")
    g = torch.Generator(device="cuda").manual_seed(4)
    losses = []
    for _ in range(6):
        x = torch.randn(64, 512, device="cuda", generator=g)
        loss = f(x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(round(loss.item(), 4))
    return {"out": losses, "strict": False}


def mempool(torch):
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        a = torch.ones(1 << 20, device="cuda")
        b = a * 3
    c = torch.ones(1 << 20, device="cuda")  # outside the pool
    in_pool = sum(s["total_size"] for s in pool.snapshot())
    pool_ptrs = {blk["address"] for s in pool.snapshot() for blk in s["blocks"] if blk["state"] == "active_allocated"}
    out = [b.sum().item() + c.sum().item(), in_pool, a.data_ptr() in pool_ptrs, c.data_ptr() in pool_ptrs,
           pool.use_count()]
    del a, b
    del pool
    torch.cuda.empty_cache()
    return {"out": out, "strict": True}


def oom(torch):
    torch.cuda.set_per_process_memory_fraction(0.02)
    held, caught, message = [], 0, ""
    try:
        for _ in range(1000):
            held.append(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"))
    except torch.OutOfMemoryError as e:
        caught = 1
        message = str(e).split("\n")[0][:40]
    n = len(held)
    held.clear()
    torch.cuda.empty_cache()
    after = torch.cuda.memory_reserved()
    x = torch.ones(1 << 20, device="cuda").sum().item()  # the process goes on
    return {"out": [caught, n, after, x, message.startswith("CUDA out of memory")], "strict": True}


def streams(torch):
    side = torch.cuda.Stream()
    total = 0.0
    for i in range(8):
        host = torch.full((1 << 20,), float(i), pin_memory=True)
        with torch.cuda.stream(side):
            dev = host.to("cuda", non_blocking=True)
            dev.record_stream(torch.cuda.current_stream())
        torch.cuda.current_stream().wait_stream(side)
        total += (dev * 2).sum().item()
        del dev
    return {"out": [total], "strict": True}


def _child_double(queue_in, queue_out):
    import torch
    t = queue_in.get()
    queue_out.put(t.sum().item())
    r = torch.full((1000,), 5.0, device="cuda")  # the child's own allocator (native)
    queue_out.put(r)
    queue_in.get()  # keep r alive until the parent has read it


def ipc(torch):
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_child_double, args=(q_in, q_out))
    p.start()
    t = torch.arange(1000, device="cuda", dtype=torch.float32)[1:]  # an offset inside the allocation
    q_in.put(t)
    got_sum = q_out.get(timeout=120)
    r = q_out.get(timeout=120)
    back = r.sum().item()
    del r
    q_in.put(None)
    p.join(timeout=120)
    return {"out": [got_sum, back, p.exitcode], "strict": True}


def stats_snapshot(torch):
    import pickle
    torch.cuda.memory._set_allocator_settings("garbage_collection_threshold:0.5")
    torch.cuda.memory._record_memory_history(max_entries=10000, stacks="python")
    xs = [torch.empty(n, device="cuda") for n in (1000, 300000, 5 << 20)]
    del xs[1]
    s = torch.cuda.memory_stats()
    snap = torch.cuda.memory._snapshot()
    seg_total = sum(seg["total_size"] for seg in snap["segments"])
    traced = len(snap["device_traces"][0])
    path = os.path.join(tempfile.mkdtemp(), "snap.pickle")
    torch.cuda.memory._dump_snapshot(path)
    with open(path, "rb") as f:
        loaded = pickle.load(f)
    torch.cuda.memory._record_memory_history(enabled=None)
    out = [seg_total == s["reserved_bytes.all.current"], traced > 0, len(loaded["segments"]) == len(snap["segments"]),
           torch.cuda.max_memory_reserved() == s["reserved_bytes.all.peak"],
           torch.cuda.memory_allocated() == s["allocated_bytes.all.current"]]
    summary = torch.cuda.memory_summary()
    out.append("Allocated memory" in summary)
    out.append(snap.get("allocator_settings", {}).get("garbage_collection_threshold"))
    # Python stacks: on the live blocks, and on the trace's allocations and frees.
    out.append(any(b.get("frames") for seg in snap["segments"] for b in seg["blocks"]
                   if b["state"] == "active_allocated"))
    trace = snap["device_traces"][0]
    out.append(all(e.get("frames") for e in trace if e["action"] in ("alloc", "free_requested")))
    return {"out": out, "strict": True}


def _ddp_rank(rank, backend, lib, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
    torch = setup(backend, lib)
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda(), device_ids=[rank])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator(device="cuda").manual_seed(10 + rank)
    losses = []
    for _ in range(8):
        x = torch.randn(64, 1024, device="cuda", generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(round(loss.item(), 4))
    weight = round(next(model.parameters()).double().sum().item(), 3)
    dist.barrier()
    dist.destroy_process_group()
    results.put((rank, losses, weight, figures(torch)))


def ddp(torch):
    """DDP over NCCL on two GPUs, NCCL keeping its inputs alive by stashing them."""
    os.environ.setdefault("TORCH_NCCL_AVOID_RECORD_STREAMS", "1")
    return _ddp(torch)


def _ddp(torch):
    if torch.cuda.device_count() < 2:
        return {"skip": "needs two GPUs"}
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    backend = os.environ["TENSORMEM_REAL_CLIENT_BACKEND"]
    procs = [ctx.Process(target=_ddp_rank, args=(r, backend, os.environ.get("TENSORMEM_TORCH_LIB"), port, results))
             for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(results.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    # Memory figures are reported, not compared: when a bucket's memory is reused depends on when
    # NCCL's kernels finish, and native runs differ among themselves (peak reserved 200-236 MiB).
    return {"out": [[r, losses, weight] for r, losses, weight, _ in got] + [[p.exitcode for p in procs]],
            "strict": False,
            "peak_reserved": [f["peak_reserved"] for *_, f in got],
            "device_allocs": [f["device_allocs"] for *_, f in got]}


def ddp_register(torch):
    """DDP with NCCL registering the allocator's segments (PyTorch's trace-tracker hook), inputs kept
    alive by record_stream."""
    os.environ["TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK"] = "1"
    return _ddp(torch)


WORKLOADS = {f.__name__: f for f in (cnn_amp, transformer_varlen, compile_infer, compile_train, mempool, oom,
                                      streams, ipc, stats_snapshot, ddp, ddp_register)}


def child(backend, lib, name):
    os.environ["TENSORMEM_REAL_CLIENT_BACKEND"] = backend
    if lib:
        os.environ["TENSORMEM_TORCH_LIB"] = lib
    torch = setup(backend, lib)
    result = WORKLOADS[name](torch)
    for key, value in figures(torch).items():
        result.setdefault(key, value)
    print("result," + json.dumps(result), flush=True)


def run(backend, lib, name):
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="inductor-"), PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, __file__, "--child", backend, "--lib", lib or "", name],
                          capture_output=True, text=True, env=env, timeout=600)
    for line in proc.stdout.splitlines():
        if line.startswith("result,"):
            return json.loads(line[len("result,"):]), proc
    return None, proc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib")
    ap.add_argument("--child")
    ap.add_argument("--out")
    ap.add_argument("workloads", nargs="*")
    args = ap.parse_args()
    if args.child:
        child(args.child, args.lib or None, args.workloads[0])
        return 0
    names = args.workloads or list(WORKLOADS)
    failed, table = 0, {}
    for name in names:
        native, p1 = run("native", args.lib, name)
        ours, p2 = run("tensormem", args.lib, name)
        table[name] = {"native": native, "tensormem": ours}
        if native is None or ours is None:
            failed += 1
            bad = p1 if native is None else p2
            print(f"FAIL {name}: a run died ({bad.returncode}):\n{bad.stdout[-3000:]}\n{bad.stderr[-6000:]}", flush=True)
            continue
        if "skip" in native:
            print(f"SKIP {name}: {native['skip']}")
            continue
        problems = []
        if native["out"] != ours["out"]:
            problems.append(f"outputs {native['out']} vs {ours['out']}")
        if ours["allocator"] == native["allocator"]:
            problems.append(f"both runs used the {ours['allocator']} allocator")
        if native["strict"]:
            for key in ("peak_reserved", "device_allocs"):
                if native[key] != ours[key]:
                    problems.append(f"{key} {native[key]} vs {ours[key]}")
        line = (f"{name}: out {ours['out']}; peak reserved {native['peak_reserved']} / {ours['peak_reserved']}; "
                f"device allocs {native['device_allocs']} / {ours['device_allocs']}")
        if problems:
            failed += 1
            print(f"FAIL {line}: " + "; ".join(problems), flush=True)
        else:
            print(f"PASS {line}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(table, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

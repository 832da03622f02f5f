"""Ordinary PyTorch programs on PyTorch's native allocator and on tensormem's, each in a fresh process.

    python3 real_clients.py [--lib PATH/libtensormem_torch.so] [--conf SETTINGS] [--timeout SECONDS]
                            [--out results.json] [WORKLOAD ...]

Each workload is seeded and runs with deterministic algorithms; it prints one JSON line (prefix
"result,") with its outputs, peak reserved bytes and device allocations (from torch.cuda.memory_stats(),
which answers on either allocator). The driver runs each workload natively, then on tensormem
(tensormem_torch.install(mode="native")), and prints a verdict per workload: PASS when the outputs are
equal and, where the workload says they must be, peak reserved bytes and device allocations too.
Exits 1 if any workload fails. Workloads that need what this host lacks (two GPUs; for ipc_expandable,
the pidfd_getfd permission PyTorch itself needs) print SKIP. WORKLOAD_ENV gives a workload's processes
their environment (allocator settings) on both allocators. --conf adds allocator settings to every
workload's processes on both allocators (PYTORCH_CUDA_ALLOC_CONF, and TENSORMEM_ALLOC_CONF where a workload
sets it): `--conf backend:cudaMallocAsync` runs each program on PyTorch's cudaMallocAsync backend and on
tensormem's. Under that backend the driver's memory pool, not either allocator, decides what is reserved,
so peak reserved bytes and device allocations are reported there, not compared; and a workload that
PyTorch's allocator refuses part of under those settings passes when tensormem refuses it with the same
message (its first line). --timeout bounds each run of a workload (a run past it is a failure).
"""
import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
# The scripts beside this one; in a checkout, the package in the crate's python/ (else the installed one).
PACKAGE_ROOT = os.path.normpath(os.path.join(HERE, "..", "..", "python"))
sys.path.insert(0, HERE)
if os.path.isdir(os.path.join(PACKAGE_ROOT, "tensormem_torch")):
    sys.path.insert(1, PACKAGE_ROOT)


PLUGIN = None  # the tensormem_torch.Plugin serving this process, if any


def setup(backend, lib):
    global PLUGIN
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if backend == "tensormem":
        import tensormem_torch
        PLUGIN = tensormem_torch.install(lib, mode="native")
    import torch
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    return torch


def figures(torch):
    torch.cuda.synchronize()
    s = torch.cuda.memory_stats()
    # Whether tensormem served the process: installed, and its own figures saw whatever PyTorch's did (under
    # backend:cudaMallocAsync both allocators are named "cudaMallocAsync", as PyTorch's code tests that name).
    served = PLUGIN is not None and (s["reserved_bytes.all.peak"] == 0
                                     or PLUGIN.stats(torch.cuda.current_device())["reserved_bytes.all.peak"] > 0)
    return {"peak_reserved": s["reserved_bytes.all.peak"], "device_allocs": s.get("num_device_alloc"),
            "allocator": torch.cuda.memory.get_allocator_backend(), "tensormem": served}


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


def mempool_options(torch):
    """MemPool(no_split=True): every block a whole segment; MemPool(use_on_oom=True) under a memory
    fraction: a request that would run out of memory is served from the pool's free block (before the
    cache is released), and one the pool cannot serve still raises."""
    ns = torch.cuda.MemPool(no_split=True)
    with torch.cuda.use_mem_pool(ns):
        small1 = torch.empty(1000, dtype=torch.uint8, device="cuda")
        large = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
        small2 = torch.empty(1000, dtype=torch.uint8, device="cuda")
    segments = sorted((s["total_size"], len(s["blocks"]), s["allocated_size"]) for s in ns.snapshot())
    no_split_allocated = torch.cuda.memory_allocated()
    del small1, large, small2
    del ns
    torch.cuda.empty_cache()

    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((256 << 20) / total)
    pool = torch.cuda.MemPool(use_on_oom=True)
    with torch.cuda.use_mem_pool(pool):
        p = torch.empty(96 << 20, dtype=torch.uint8, device="cuda")
    pool_ptr = p.data_ptr()
    del p  # cached in the pool
    hold = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    x = torch.empty(96 << 20, dtype=torch.uint8, device="cuda")  # 224 + 96 MiB > 256 MiB
    served = x.data_ptr() == pool_ptr
    x.fill_(7)
    value = int(x[:1024].sum().item())
    caught = 0
    try:
        torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError:
        caught = 1
    ooms = torch.cuda.memory_stats()["num_ooms"]
    del x, hold
    del pool
    torch.cuda.empty_cache()
    return {"out": [segments, no_split_allocated, served, value, caught, ooms], "strict": True}


_OWN_ALLOCATOR_C = r"""
#include <dlfcn.h>
#include <stddef.h>
#include <sys/types.h>
typedef int (*alloc_t)(unsigned long long*, size_t);
typedef int (*free_t)(unsigned long long);
static alloc_t cu_alloc;
static free_t cu_free;
static long allocs, frees;
static void load(void) {
    if (cu_alloc) return;
    void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    cu_alloc = (alloc_t)dlsym(h, "cuMemAlloc_v2");
    cu_free = (free_t)dlsym(h, "cuMemFree_v2");
}
void* own_alloc(ssize_t size, int device, void* stream) {
    unsigned long long p = 0;
    load();
    if (cu_alloc(&p, (size_t)size) != 0) return NULL;
    __atomic_add_fetch(&allocs, 1, __ATOMIC_SEQ_CST);
    return (void*)p;
}
void own_free(void* ptr, ssize_t size, int device, void* stream) {
    load();
    cu_free((unsigned long long)ptr);
    __atomic_add_fetch(&frees, 1, __ATOMIC_SEQ_CST);
}
long own_allocs(void) { return allocs; }
long own_frees(void) { return frees; }
"""


def mempool_own_allocator(torch):
    """MemPool(allocator=CUDAPluggableAllocator(...)), what sleep modes (vLLM's) build on: the pool's
    segments come from the user's alloc function and go back through its free function."""
    import ctypes
    import shutil
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return {"skip": "no C compiler for the pluggable allocator", "out": None, "strict": False}
    build = tempfile.mkdtemp(prefix="own-alloc-")
    src, lib = os.path.join(build, "own.c"), os.path.join(build, "libown.so")
    with open(src, "w") as f:
        f.write(_OWN_ALLOCATOR_C)
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", lib, src, "-ldl"], check=True)
    counters = ctypes.CDLL(lib)
    torch.cuda.init()
    allocator = torch.cuda.memory.CUDAPluggableAllocator(lib, "own_alloc", "own_free")
    pool = torch.cuda.MemPool(allocator.allocator())
    with torch.cuda.use_mem_pool(pool):
        a = torch.full((1 << 20,), 2.0, device="cuda")
        b = torch.full((3 << 20,), 3.0, device="cuda")
        c = torch.arange(1000, device="cuda", dtype=torch.float32)
    outside = torch.ones(1 << 20, device="cuda")
    value = (a.sum() + b.sum() + c.sum() + outside.sum()).item()
    segments = sorted(s["total_size"] for s in pool.snapshot())
    allocs_in_pool = counters.own_allocs()
    stats = torch.cuda.memory_stats()
    del a, b, c
    del pool
    torch.cuda.empty_cache()
    return {"out": [value, segments, allocs_in_pool, counters.own_frees(), stats["segment.all.current"]],
            "strict": True}


def _oom_words(message):
    """An out-of-memory message of the caching allocator with its figures taken out (sizes, the GPU's
    number, process ids): what must read the same on both allocators. None for another message (the
    cudaMallocAsync backend's)."""
    import re
    first = message.split("\n")[0]
    if not first.startswith("CUDA out of memory. Tried to allocate"):
        return None
    first = re.sub(r"\d+(\.\d+)? (bytes|KiB|MiB|GiB)", "SIZE", first)
    return re.sub(r"(GPU|Process) \d+", r"\1 N", first)


def oom(torch):
    torch.cuda.set_per_process_memory_fraction(0.02)
    held, caught, message = [], 0, ""
    try:
        for _ in range(1000):
            held.append(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"))
    except torch.OutOfMemoryError as e:
        caught = 1
        message = str(e)
    n = len(held)
    held.clear()
    torch.cuda.empty_cache()
    after = torch.cuda.memory_reserved()
    x = torch.ones(1 << 20, device="cuda").sum().item()  # the process goes on
    # PyTorch's message word for word on tensormem too: its sentences, figures aside.
    return {"out": [caught, n, after, x, message.startswith("CUDA out of memory"), _oom_words(message)],
            "strict": True}


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


# Expandable-segment sharing: byte tensors of odd sizes (both pools, one block over two 20 MiB
# chunks) and views into them at odd offsets, none touching another's first or last byte.
_EXPANDABLE_SIZES = (1, 1000, (1 << 20) + 3, (25 << 20) + 7)
# Device memory a process may still miss after everything shared was released: less than one chunk.
_LEAK = 2 << 20


def _expandable_tensors(torch):
    """The shared tensors (random bytes, made on the CPU and copied over) and their digests."""
    bases = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
             for seed, n in enumerate(_EXPANDABLE_SIZES)]
    bases = [b.cuda() for b in bases]
    views = [bases[1][7:993], bases[2][12345:-17], bases[3][(3 << 20) + 1:(24 << 20) + 5]]
    tensors = bases + views
    return tensors, [_digest(t) for t in tensors]


def _digest(t):
    """A digest of a CUDA byte tensor's contents, read back with a copy (no kernel runs, so no module
    loads and takes device memory while free memory is being compared)."""
    import hashlib
    return hashlib.sha1(t.cpu().numpy().tobytes()).hexdigest()


def _mark(torch, tensors, value):
    """Writes value + i to the first and last byte of tensor i (copies from the host), and waits."""
    for i, t in enumerate(tensors):
        byte = torch.tensor([value + i], dtype=torch.uint8)
        t[:1].copy_(byte)
        t[-1:].copy_(byte)
    torch.cuda.synchronize()


def _marked(tensors, value):
    """Whether every tensor carries the marks _mark wrote."""
    return all(int(t[:1].cpu()) == value + i and int(t[-1:].cpu()) == value + i for i, t in enumerate(tensors))


def _free_device_bytes(torch):
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def _all_expandable(torch):
    segments = torch.cuda.memory._snapshot()["segments"]
    return bool(segments) and all(s.get("is_expandable") for s in segments)


def _warm_up(torch):
    """Does once what the workload does (context, allocation, copies both ways), then gives it back, so
    that free device memory measured afterwards moves only with what is shared."""
    t = torch.zeros(3 << 20, dtype=torch.uint8).cuda()
    _digest(t)
    _mark(torch, [t], 1)
    del t
    torch.cuda.empty_cache()
    _free_device_bytes(torch)


def _release(torch, gc, tensors):
    tensors.clear()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.ipc_collect()
    torch.cuda.empty_cache()


def _expect(queue, tag):
    got, value = queue.get(timeout=120)
    if got != tag:
        raise RuntimeError(f"expected {tag!r} from the other process, got {got!r}: {value}")
    return value


def _child_expandable(to_child, to_parent):
    """The native side of ipc_expandable: consumes the parent's tensors, then produces its own."""
    import gc
    import torch
    _warm_up(torch)
    to_parent.put(("ready", None))
    # The parent produces, this process consumes.
    try:
        got = to_child.get(timeout=120)
    except Exception as e:  # noqa: BLE001 - PyTorch could not open the memory; the parent says why
        to_parent.put(("error", f"{type(e).__name__}: {e}"))
        return
    digests = [_digest(t) for t in got]
    _mark(torch, got, 0xA0)
    to_parent.put(("opened", digests))
    _expect(to_child, "marked")
    seen = _marked(got, 0x50)
    _release(torch, gc, got)
    to_parent.put(("released", seen))
    # This process produces, the parent consumes.
    _expect(to_child, "produce")
    before = _free_device_bytes(torch)
    tensors, digests = _expandable_tensors(torch)
    expandable = _all_expandable(torch)
    to_parent.put(("tensors", tensors))
    opened = _expect(to_child, "opened")
    if opened is None:
        return
    seen = _marked(tensors, 0xB0)
    _mark(torch, tensors, 0x60)
    to_parent.put(("marked", seen))
    _expect(to_child, "released")
    _release(torch, gc, tensors)
    drop = before - _free_device_bytes(torch)
    to_parent.put(("done", ([expandable, opened == digests, seen, drop < _LEAK,
                             torch.cuda.memory_reserved() == 0], drop)))


def _allow_ptrace_by(pid):
    """Lets process `pid` take this process's descriptors with pidfd_getfd where Yama limits ptrace to
    ancestors (kernel.yama.ptrace_scope 1): PyTorch consumes expandable-segment memory that way."""
    import ctypes
    pr_set_ptracer = 0x59616D61
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_ptracer, ctypes.c_ulong(pid), 0, 0, 0)


def ipc_expandable(torch):
    """Memory of expandable segments through torch.multiprocessing both ways with a native process:
    this process produces and the child consumes, then the reverse; contents, writes seen on the other
    side, and all device memory given back once both sides let go."""
    import gc
    import torch.multiprocessing as mp
    native = os.environ["TENSORMEM_REAL_CLIENT_BACKEND"] == "native"
    ctx = mp.get_context("spawn")
    to_child, to_parent = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_child_expandable, args=(to_child, to_parent))
    p.start()
    _allow_ptrace_by(p.pid)
    try:
        _warm_up(torch)
        _expect(to_parent, "ready")
        # This process produces.
        before = _free_device_bytes(torch)
        tensors, digests = _expandable_tensors(torch)
        expandable = _all_expandable(torch)
        to_child.put(tensors)
        tag, opened = to_parent.get(timeout=120)
        if tag == "error" and native:
            return {"skip": f"PyTorch cannot open another process's expandable-segment memory here: {opened}"}
        if tag != "opened":
            raise RuntimeError(f"the native consumer failed: {opened}")
        seen = _marked(tensors, 0xA0)
        _mark(torch, tensors, 0x50)
        to_child.put(("marked", None))
        seen_there = _expect(to_parent, "released")
        _release(torch, gc, tensors)
        drop = before - _free_device_bytes(torch)
        produced = [expandable, opened == digests, seen, seen_there, drop < _LEAK, torch.cuda.memory_reserved() == 0]
        # The child produces.
        to_child.put(("produce", None))
        try:
            got = _expect(to_parent, "tensors")
        except Exception as e:  # noqa: BLE001
            to_child.put(("opened", None))
            if native:
                return {"skip": f"PyTorch cannot open another process's expandable-segment memory here: {e}"}
            raise
        digests = [_digest(t) for t in got]
        _mark(torch, got, 0xB0)
        to_child.put(("opened", digests))
        _expect(to_parent, "marked")
        seen = _marked(got, 0x60)
        _release(torch, gc, got)
        to_child.put(("released", None))
        consumed, child_drop = _expect(to_parent, "done")
        consumed.append(seen)
        p.join(timeout=60)
        return {"out": [produced, consumed, p.exitcode], "strict": False,
                "notes": f"device memory not given back: {drop} B here, {child_drop} B in the child"}
    finally:
        if p.is_alive():
            p.kill()


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


def allocator_settings(torch):
    """Allocator settings changed at run time through each way PyTorch offers (the binding
    torch._C._accelerator_setAllocatorSettings, which PyTorch 2.10 and later tell users to call, and the
    deprecated torch.cuda.memory._set_allocator_settings): after each, the snapshot's allocator_settings
    show the new values, PyTorch's own on its allocator and tensormem's on tensormem."""
    import warnings
    kept = torch.empty(1 << 20, device="cuda")  # the allocator is in use
    ways = [("torch.cuda.memory._set_allocator_settings", torch.cuda.memory._set_allocator_settings)]
    if hasattr(torch._C, "_accelerator_setAllocatorSettings"):
        ways.insert(0, ("torch._C._accelerator_setAllocatorSettings", torch._C._accelerator_setAllocatorSettings))
    out = []
    for (name, way), (mb, gc) in zip(ways, ((40, 0.5), (60, 0.75))):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the helper's deprecation
            way(f"max_split_size_mb:{mb},garbage_collection_threshold:{gc}")
        settings = torch.cuda.memory._snapshot()["allocator_settings"]
        seen = [settings.get("max_split_size"), settings.get("garbage_collection_threshold")]
        out.append([name, seen == [mb << 20, gc], seen])
    del kept
    return {"out": out, "strict": False}


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


def sleep_wake(torch):
    """A CUDA graph captured into a MemPool on expandable segments. On tensormem the pool sleeps with its
    contents (its memory back to the device, seen in mem_get_info), wakes at the same addresses, and the
    graph replays to the same result as before; PyTorch's allocator has no sleep, so natively the graph
    just replays again. Either way: the replay after equals the replay before, bit for bit."""
    g = torch.Generator(device="cuda").manual_seed(5)
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        static_in = torch.randn(256, 1024, device="cuda", generator=g)
        weight = torch.randn(1024, 1024, device="cuda", generator=g)
        table = torch.randn(64 << 20, device="cuda", generator=g)  # 256 MiB, for the memory to show
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            torch.relu(static_in @ weight).sum(dim=1) + table[:256]
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool.id):
        static_out = torch.relu(static_in @ weight).sum(dim=1) + table[:256]
    graph.replay()
    torch.cuda.synchronize()
    before = static_out.clone()
    ptrs = [t.data_ptr() for t in (static_in, weight, table, static_out)]
    static_out.zero_()
    notes, returned_enough, asleep_refused = "", True, True
    if os.environ.get("TENSORMEM_REAL_CLIENT_BACKEND") == "tensormem":
        import tensormem_torch
        free_before = _free_device_bytes(torch)
        reserved_before = torch.cuda.memory_reserved()
        released = tensormem_torch.sleep(pool, keep_contents=True)
        free_asleep = _free_device_bytes(torch)
        returned_enough = released >= 256 << 20 and free_asleep - free_before >= 0.95 * released
        asleep_refused = False
        try:
            with torch.cuda.use_mem_pool(pool):
                torch.empty(1 << 20, device="cuda")
        except RuntimeError:
            asleep_refused = True
        reserved_drop = reserved_before - torch.cuda.memory_reserved()
        returned_enough = returned_enough and reserved_drop == released
        tensormem_torch.wake(pool)
        returned_enough = returned_enough and torch.cuda.memory_reserved() == reserved_before
        notes = (f"released {released >> 20} MiB, free memory +{(free_asleep - free_before) >> 20} MiB, "
                 f"memory_reserved() -{reserved_drop >> 20} MiB while asleep")
    graph.replay()
    torch.cuda.synchronize()
    out = [torch.equal(before, static_out), ptrs == [t.data_ptr() for t in (static_in, weight, table, static_out)],
           returned_enough, asleep_refused, list(static_out.shape)]
    del graph, static_in, weight, table, static_out, before
    del pool
    torch.cuda.empty_cache()
    return {"out": out, "strict": False, "notes": notes}


def regions(torch):
    """An engine's memory in two tagged regions: weights (kept) and a KV cache (discarded), with a CUDA
    graph captured over both. On tensormem both regions sleep at once (their memory back to the device,
    seen in mem_get_info), wake at the same addresses, the weights hold what they held and the graph,
    with the cache written again, replays to the same result; natively there are no regions (plain
    MemPools stand in) and the graph just replays again. Either way: the replay after equals the replay
    before, bit for bit."""
    on_tensormem = os.environ.get("TENSORMEM_REAL_CLIENT_BACKEND") == "tensormem"
    if on_tensormem:
        import tensormem_torch
        region = tensormem_torch.region
    else:
        made = {}

        @contextlib.contextmanager
        def region(tag):
            if tag not in made:
                made[tag] = torch.cuda.MemPool()
            pool = made[tag]
            with torch.cuda.use_mem_pool(pool):
                yield pool
    g = torch.Generator(device="cuda").manual_seed(6)
    with region("weights") as weights_pool:
        weight = torch.randn(2048, 2048, device="cuda", generator=g)
        table = torch.randn(64 << 20, device="cuda", generator=g)  # 256 MiB, for the memory to show
    with region("kv_cache") as cache_pool:
        cache = torch.empty(32 << 20, device="cuda")  # 128 MiB
        static_in = torch.empty(256, 2048, device="cuda")
    def fill_cache():
        cache.copy_(torch.arange(cache.numel(), device="cuda", dtype=torch.float32).remainder_(977))
        static_in.copy_(cache[: static_in.numel()].view_as(static_in) / 977)
    fill_cache()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            torch.relu(static_in @ weight).sum(dim=1) + table[:256] + cache[:256]
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=weights_pool.id):
        static_out = torch.relu(static_in @ weight).sum(dim=1) + table[:256] + cache[:256]
    graph.replay()
    torch.cuda.synchronize()
    before = static_out.clone()
    ptrs = [t.data_ptr() for t in (weight, table, cache, static_in, static_out)]
    static_out.zero_()
    notes, returned_enough, both_asleep = "", True, True
    if on_tensormem:
        free_before = _free_device_bytes(torch)
        released = tensormem_torch.sleep_regions(keep=["weights"], discard=["kv_cache"])
        free_asleep = _free_device_bytes(torch)
        total = sum(released.values())
        returned_enough = total >= 384 << 20 and free_asleep - free_before >= 0.95 * total
        both_asleep = tensormem_torch.is_asleep("weights") and tensormem_torch.is_asleep("kv_cache")
        mapped = tensormem_torch.wake_regions(release_host_memory=True)
        fill_cache()  # the cache was discarded: the engine writes it again
        notes = (f"released {total >> 20} MiB ({', '.join(f'{k[0]}: {v >> 20} MiB' for k, v in released.items())}), "
                 f"free memory +{(free_asleep - free_before) >> 20} MiB, mapped {sum(mapped.values()) >> 20} MiB")
    graph.replay()
    torch.cuda.synchronize()
    out = [torch.equal(before, static_out), ptrs == [t.data_ptr() for t in (weight, table, cache, static_in, static_out)],
           returned_enough, both_asleep, list(static_out.shape)]
    del graph, weight, table, cache, static_in, static_out, before, weights_pool, cache_pool
    torch.cuda.empty_cache()
    return {"out": out, "strict": False, "notes": notes}


WORKLOADS = {f.__name__: f for f in (cnn_amp, transformer_varlen, compile_infer, compile_train, mempool,
                                      mempool_options, mempool_own_allocator, oom, streams, ipc, ipc_expandable, stats_snapshot,
                                      allocator_settings, ddp, ddp_register, sleep_wake, regions)}

# The environment a workload's processes start with, on either allocator (its children inherit it).
WORKLOAD_ENV = {
    "sleep_wake": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                   "TENSORMEM_ALLOC_CONF": "expandable_segments:True"},
    "regions": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                "TENSORMEM_ALLOC_CONF": "expandable_segments:True"},
    "ipc_expandable": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                       "TENSORMEM_ALLOC_CONF": "expandable_segments:True",
                       # PyTorch builds that gate expandable-segment IPC behind it share with it set.
                       "TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC": "1"},
}


def child(backend, lib, name):
    os.environ["TENSORMEM_REAL_CLIENT_BACKEND"] = backend
    if lib:
        os.environ["TENSORMEM_TORCH_LIB"] = lib
    torch = setup(backend, lib)
    try:
        result = WORKLOADS[name](torch)
    except RuntimeError as e:
        # What the allocator refused is the result: the driver compares it between the two runs.
        print("result," + json.dumps({"refused": str(e).splitlines()[0], "tensormem": PLUGIN is not None}),
              flush=True)
        return
    for key, value in figures(torch).items():
        result.setdefault(key, value)
    print("result," + json.dumps(result), flush=True)


def workload_env(name, conf):
    """The allocator settings of a workload's processes, with --conf's added."""
    env = dict(WORKLOAD_ENV.get(name, {}))
    if conf:
        for key in ("PYTORCH_CUDA_ALLOC_CONF", "TENSORMEM_ALLOC_CONF"):
            if key in env:
                env[key] += "," + conf
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", conf)
    return env


def run(backend, lib, name, conf=None, timeout=600):
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="inductor-"), PYTHONUNBUFFERED="1")
    env.update(workload_env(name, conf))
    try:
        proc = subprocess.run([sys.executable, __file__, "--child", backend, "--lib", lib or "", name],
                              capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
        return None, subprocess.CompletedProcess(e.cmd, f"timed out after {timeout} s", text(e.stdout), text(e.stderr))
    for line in proc.stdout.splitlines():
        if line.startswith("result,"):
            return json.loads(line[len("result,"):]), proc
    return None, proc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib")
    ap.add_argument("--child")
    ap.add_argument("--conf", help="allocator settings added to every workload's, on both allocators")
    ap.add_argument("--timeout", type=float, default=600, help="seconds each run of a workload may take")
    ap.add_argument("--out")
    ap.add_argument("workloads", nargs="*")
    args = ap.parse_args()
    if args.child:
        child(args.child, args.lib or None, args.workloads[0])
        return 0
    names = args.workloads or list(WORKLOADS)
    # Under that backend the driver's pool, not either allocator, decides what is reserved.
    async_backend = "backend:cudaMallocAsync" in (args.conf or "")
    failed, table = 0, {}
    for name in names:
        label = f"{name} ({args.conf})" if args.conf else name
        native, p1 = run("native", args.lib, name, args.conf, args.timeout)
        ours, p2 = run("tensormem", args.lib, name, args.conf, args.timeout)
        table[name] = {"native": native, "tensormem": ours}
        if native is None or ours is None:
            failed += 1
            bad = p1 if native is None else p2
            print(f"FAIL {name}: a run died ({bad.returncode}):\n{bad.stdout[-3000:]}\n{bad.stderr[-6000:]}", flush=True)
            continue
        if "skip" in native:
            print(f"SKIP {name}: {native['skip']}")
            continue
        if "refused" in native or "refused" in ours:
            # Under settings PyTorch's own allocator refuses part of a program under (--conf), tensormem must
            # refuse it with the same error, serving its run; without them, an error is a failure.
            alike = (bool(args.conf) and native.get("refused") == ours.get("refused")
                     and ours["tensormem"] and not native["tensormem"])
            failed += not alike
            print(f"{'PASS' if alike else 'FAIL'} {label}: "
                  f"refused: native {native.get('refused')!r} / tensormem {ours.get('refused')!r}", flush=True)
            continue
        problems = []
        if native["out"] != ours["out"]:
            problems.append(f"outputs {native['out']} vs {ours['out']}")
        if not ours["tensormem"] or native["tensormem"]:
            problems.append(f"tensormem served neither run or both (allocators {native['allocator']} / "
                            f"{ours['allocator']})")
        if native["allocator"] != ours["allocator"] and async_backend:
            problems.append(f"allocators {native['allocator']} / {ours['allocator']}: both must be cudaMallocAsync")
        if native["strict"] and not async_backend:
            for key in ("peak_reserved", "device_allocs"):
                if native[key] != ours[key]:
                    problems.append(f"{key} {native[key]} vs {ours[key]}")
        line = (f"{label}: out {ours['out']}; peak reserved {native['peak_reserved']} / {ours['peak_reserved']}; "
                f"device allocs {native['device_allocs']} / {ours['device_allocs']}")
        if "notes" in ours:
            line += f"; native: {native.get('notes')}; tensormem: {ours['notes']}"
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

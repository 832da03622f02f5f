"""Anchor: a model's weights from one GPU into another GPU's own parameters through NCCL, done the ways
PyTorch-based stacks do it (the counterpart of the project's `nccl_weights_bench`).

Two processes (torch.multiprocessing, spawn): rank 0 on cuda:0 sends, rank 1 on cuda:1 receives, one
torch.distributed process group (backend "nccl", NVLink multicast off). Both hold the layout's parameters;
rank 0's parameter i is filled with i % 251 + 1. One sync = rank 1's parameters hold rank 0's values and
rank 1 has synchronized. Methods:
  per_tensor  one dist.broadcast per parameter, straight into it (a collective per tensor).
  bucketed    parameters grouped in order into buckets of at most 256 MiB (a larger one alone); rank 0
              flattens a bucket (torch.cat) and broadcasts it; rank 1 broadcasts into a bucket buffer and
              copies its slices into its parameters (torch._foreach_copy_), bucket after bucket.
  nccl        the floor: dist.broadcast of a 1 GiB buffer (for a broadcast NCCL's bus bandwidth is bytes /
              time), measured before each layout's methods.
Timed on rank 1, after a barrier: the first sync and the median of later syncs. After the first sync of each
method rank 1 checks the first and last element of every parameter.

  python3 torch_nccl_weights_bench.py [7b|moe|gpt2|all] [ITERS]
`all` (the default) is 7b and moe; ITERS defaults to 10. Prints CSV
  layout,method,tensors,bytes,first_ms,median_ms,gbps,nccl_gbps,ratio
where ratio is median_ms over the time of the layout's bytes at the nccl row's bandwidth.
"""
import os, socket, statistics, sys, time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_refit_bench import layout  # the shapes of benches/src/layouts.rs

BUCKET = 256 << 20
GIB = 1 << 30


def fill(i):
    return float(i % 251 + 1)


def groups(params):
    """Indices of parameters in order, each group at most BUCKET bytes (a larger parameter alone)."""
    out, cur, size = [], [], 0
    for i, p in enumerate(params):
        n = p.numel() * p.element_size()
        if cur and size + n > BUCKET:
            out.append(cur); cur, size = [], 0
        cur.append(i); size += n
    if cur:
        out.append(cur)
    return out


def nccl_floor(iters):
    buf = torch.empty(GIB, dtype=torch.uint8, device="cuda")
    rates = []
    for i in range(3 + iters):
        dist.barrier(); torch.cuda.synchronize()
        t0 = time.perf_counter()
        dist.broadcast(buf, src=0)
        torch.cuda.synchronize()
        if i >= 3:
            rates.append(GIB / (time.perf_counter() - t0) / 1e9)
    del buf
    torch.cuda.empty_cache()
    return statistics.median(rates)


def per_tensor(rank, params, state):
    for p in params:
        dist.broadcast(p, src=0)


def bucketed(rank, params, state):
    for idx in state["groups"]:
        if rank == 0:
            dist.broadcast(torch.cat([params[i].view(-1) for i in idx]), src=0)
        else:
            flat = state["buf"][:sum(params[i].numel() for i in idx)]
            dist.broadcast(flat, src=0)
            dst, src, off = [], [], 0
            for i in idx:
                n = params[i].numel()
                dst.append(params[i]); src.append(flat[off:off + n].view(params[i].shape)); off += n
            torch._foreach_copy_(dst, src)


def check(params):
    for i, p in enumerate(params):
        flat = p.view(-1)
        for got in (flat[0].item(), flat[-1].item()):
            assert got == fill(i), f"parameter {i}: {got} instead of {fill(i)}"


def worker(rank, names, iters):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2)
    for name in names:
        shapes, dtype = layout(name)
        params = [torch.full(s, fill(i) if rank == 0 else 0.0, dtype=dtype, device="cuda")
                  for i, s in enumerate(shapes)]
        nbytes = sum(p.numel() * p.element_size() for p in params)
        torch.cuda.synchronize()
        nccl_gbps = nccl_floor(iters)
        if rank == 1:
            print(f"{name},nccl,1,{GIB},,{GIB / nccl_gbps / 1e6:.2f},{nccl_gbps:.1f},{nccl_gbps:.1f},1.000", flush=True)
        gs = groups(params)
        state = {"groups": gs}
        if rank == 1:
            most = max(sum(params[i].numel() for i in idx) for idx in gs)
            state["buf"] = torch.empty(most, dtype=dtype, device="cuda")
        for method, sync in (("per_tensor", per_tensor), ("bucketed", bucketed)):
            if rank == 1:
                for p in params:
                    p.zero_()
            times = []
            for r in range(iters + 1):
                dist.barrier(); torch.cuda.synchronize()
                t0 = time.perf_counter()
                sync(rank, params, state)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                if r == 0 and rank == 1:
                    check(params)
            if rank == 1:
                med = statistics.median(times[1:])
                floor = nbytes / (nccl_gbps * 1e9)
                print(f"{name},{method},{len(params)},{nbytes},{times[0]*1e3:.2f},{med*1e3:.2f},"
                      f"{nbytes / med / 1e9:.1f},{nccl_gbps:.1f},{med / floor:.3f}", flush=True)
        del params, state
        torch.cuda.empty_cache()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    iters = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    if which not in ("7b", "moe", "gpt2", "all"):
        sys.exit(f"torch_nccl_weights_bench: no layout {which}")
    names = ["7b", "moe"] if which == "all" else [which]
    if torch.cuda.device_count() < 2:
        sys.exit("torch_nccl_weights_bench: two GPUs needed")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    print("layout,method,tensors,bytes,first_ms,median_ms,gbps,nccl_gbps,ratio", flush=True)
    mp.spawn(worker, args=(names, iters), nprocs=2)

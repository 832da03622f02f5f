"""tensormem_torch.nccl_weights between two processes on two GPUs: rank 0 sends, rank 1 receives into its own tensors.

    python3 nccl_weights_check.py [--lib PATH/libtensormem_torch.so] [--bucket-mib 64]

Two ranks (torch.multiprocessing, spawn), one GPU each, share NCCL's id through a torch.distributed.FileStore.
Checks:

  gpt2        a GPT-2-small-sized fp32 state dict (148 tensors, 498 MB; rank 1 allocates its tensors in reverse
              order): rank 0 writes version k's values and syncs, twice; rank 1 compares every tensor with them
  mismatch    rank 1 lacks a tensor and has one of another shape: both ranks raise NcclWeightsError before any
              weight moves, rank 1's naming both tensors

NCCL comes from PyTorch's wheel when no other is on the loader's path (nccl_weights.nccl_library_dir(), put on
LD_LIBRARY_PATH before the ranks start); NVLink multicast stays off (NCCL_NVLS_ENABLE=0). Prints "PASS name: ...",
"FAIL name: why" or "SKIP name: why" (fewer than two GPUs, no PyTorch); exits 1 if any failed.
"""
import argparse
import os
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE_ROOT = os.path.normpath(os.path.join(HERE, "..", "..", "python"))
if os.path.isdir(os.path.join(PACKAGE_ROOT, "tensormem_torch")):
    sys.path.insert(0, PACKAGE_ROOT)

VERSIONS = 2


def gpt2_small(torch, device, reverse=False):
    """GPT-2 small's parameters (zeros), in state-dict order; allocated in reverse order with ``reverse``."""
    d, vocab, ctx, layers = 768, 50257, 1024, 12
    shapes = [("wte.weight", (vocab, d)), ("wpe.weight", (ctx, d))]
    for i in range(layers):
        p = f"h.{i}."
        shapes += [(p + "ln_1.weight", (d,)), (p + "ln_1.bias", (d,)),
                   (p + "attn.c_attn.weight", (d, 3 * d)), (p + "attn.c_attn.bias", (3 * d,)),
                   (p + "attn.c_proj.weight", (d, d)), (p + "attn.c_proj.bias", (d,)),
                   (p + "ln_2.weight", (d,)), (p + "ln_2.bias", (d,)),
                   (p + "mlp.c_fc.weight", (d, 4 * d)), (p + "mlp.c_fc.bias", (4 * d,)),
                   (p + "mlp.c_proj.weight", (4 * d, d)), (p + "mlp.c_proj.bias", (d,))]
    shapes += [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
    order = list(reversed(shapes)) if reverse else shapes
    made = {name: torch.zeros(shape, dtype=torch.float32, device=device) for name, shape in order}
    return {name: made[name] for name, _ in shapes}


def values(torch, t, index, version):
    """Version ``version``'s values of the tensor of index ``index``: exact in float32, different per version."""
    base = torch.arange(t.numel(), device=t.device, dtype=torch.int64) * 7 + index * 13 + version * 101 + 1
    return (base % 251).to(torch.float32).reshape(t.shape)


def rank_main(rank, lib, store_path, bucket_mib, results):
    try:
        if lib:
            os.environ["TENSORMEM_TORCH_LIB"] = lib
        import torch
        from tensormem_torch import nccl_weights
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        store = torch.distributed.FileStore(store_path, 2)
        named = gpt2_small(torch, device, reverse=rank == 1)
        index = {name: i for i, name in enumerate(named)}
        notes = []
        with nccl_weights.NcclWeights(named, rank, 2, store=store, bucket_bytes=bucket_mib << 20) as sync:
            for version in range(1, VERSIONS + 1):
                if rank == 0:
                    with torch.no_grad():
                        for name, t in named.items():
                            t.copy_(values(torch, t, index[name], version))
                report = sync.sync()
                if rank == 1:
                    wrong = [name for name, t in named.items()
                             if not torch.equal(t, values(torch, t, index[name], version))]
                    if wrong:
                        raise AssertionError(f"version {version}: {len(wrong)} tensors differ: {wrong[:5]}")
                    notes.append(f"v{report.sync} {report.bytes} bytes in {report.buckets} buckets "
                                 f"({report.direct} direct), {report.seconds * 1e3:.1f} ms")
        # A layout that differs: refused on both ranks, before any weight moves.
        if rank == 1:
            named.pop("ln_f.bias")
            named["ln_f.weight"] = torch.zeros((769,), device=device)
        try:
            nccl_weights.NcclWeights(named, rank, 2, store=store, bucket_bytes=bucket_mib << 20)
            raise AssertionError("a differing layout was accepted")
        except nccl_weights.NcclWeightsError as e:
            words = ['"ln_f.bias" is sent but not here', '"ln_f.weight" is 3072 bytes on the sender, 3076 here'] \
                if rank == 1 else ["the ranks do not agree on the weights' layout"]
            missing = [w for w in words if w not in str(e)]
            if missing:
                raise AssertionError(f"the refusal does not say {missing}: {e}") from None
        results.put((rank, "ok", notes))
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"))
        raise


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib")
    ap.add_argument("--bucket-mib", type=int, default=64)
    args = ap.parse_args()
    try:
        import torch
        import torch.multiprocessing as mp
    except ImportError as e:
        print(f"SKIP nccl_weights: no PyTorch ({e})")
        return 0
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 2:
        print(f"SKIP nccl_weights: {count} CUDA device(s); two are needed")
        return 0
    if args.lib:
        os.environ["TENSORMEM_TORCH_LIB"] = args.lib
    from tensormem_torch import nccl_weights
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    folder = nccl_weights.nccl_library_dir()
    if folder:
        os.environ["LD_LIBRARY_PATH"] = folder + (":" + os.environ["LD_LIBRARY_PATH"]
                                                  if os.environ.get("LD_LIBRARY_PATH") else "")
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.spawn(rank_main, args=(args.lib, os.path.join(tmp, "store"), args.bucket_mib, results), nprocs=2,
                     join=True)
        except Exception as e:  # noqa: BLE001 - the ranks' own reports say more
            reports = []
            while not results.empty():
                reports.append(results.get())
            why = "; ".join(f"rank {r}: {what}" for r, status, what in reports if status == "error") or str(e)
            print(f"FAIL nccl_weights: {why}", flush=True)
            return 1
    reports = {}
    while not results.empty():
        rank, _, notes = results.get()
        reports[rank] = notes
    print(f"PASS gpt2: {'; '.join(reports.get(1, []))}; {time.monotonic() - t0:.1f} s", flush=True)
    print("PASS mismatch: both ranks refused, rank 1 naming the missing tensor and the other size", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

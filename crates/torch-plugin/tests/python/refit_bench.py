"""A model's weights from a trainer process into an inference process's own parameters on the same GPU (the
colocated "refit" of RL post-training) through tensormem_torch.weights, beside the device-copy floor.

Mirrors benches/anchors' torch_refit_bench.py (the same layouts, the same sync and the same CSV), with tensormem's
methods in place of the anchor's torch.multiprocessing ones:
  floor       one process, the same bytes copied parameter to parameter with torch._foreach_copy_ (as the anchor)
  tm_foreach  the producer publishes its state dict once (Publisher); a spawned consumer holding zero parameters
              of the layout opens it once (Subscriber) and, each sync, install(method="foreach"):
              torch._foreach_copy_ from the producer's mapped tensors into its own
  tm_batched  the same with install(method="batched"): the planned copies (adjacent tensors merged) in one
              cuMemcpyBatchAsync where the driver has it
  tm_open     opening a publication alone (mapping the producer's memory, building the tensors that alias it):
              first_ms the first open in a fresh process, median_ms the median of later opens of new messages
One sync = the producer fills its last tensor with r + 2, synchronizes, starts the clock, publishes and waits until
the consumer installed the version (its copies done and synchronized, as the producer must wait before writing
again); the clock stops there. The consumer then sends back the value read from its last parameter, which is
checked. Timed: the first sync (which also sends the publication's message, opens it in the consumer and checks
and plans the layout) and the median of the later ones.

  python3 refit_bench.py [gpt2|7b|moe|all] [ROUNDS] [--plugin] [--lib PATH/libtensormem_torch.so]
      [--methods floor,tm_foreach,tm_batched,tm_open]
Prints CSV: layout,method,tensors,bytes,first_ms,median_ms. --plugin runs producer and consumer on tensormem's
allocator (tensormem_torch.install(mode="native")), else on PyTorch's own.
"""
import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE_ROOT = os.path.normpath(os.path.join(HERE, "..", "..", "python"))
if os.path.isdir(os.path.join(PACKAGE_ROOT, "tensormem_torch")):
    sys.path.insert(0, PACKAGE_ROOT)

METHODS = ("floor", "tm_foreach", "tm_batched", "tm_open")


def setup(plugin, lib):
    if lib:
        os.environ["TENSORMEM_TORCH_LIB"] = lib
    if plugin:
        import tensormem_torch
        tensormem_torch.install(lib or None, mode="native")
    import torch
    return torch


def layout(torch, name):
    """Shapes and dtype of a GPT-2-small-like (fp32), a 7B Llama-like (bf16) or a MoE (bf16: 24 layers, 128
    experts of three 2048x768 matrices, attention, router, embeddings: 9 365 tensors, 31 GB) state dict (the
    anchor's)."""
    if name == "gpt2":
        d, v, L = 768, 50257, 12
        shapes = [(v, d), (1024, d)]
        for _ in range(L):
            shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d),
                       (d,)]
        shapes += [(d,), (d,)]
        return shapes, torch.float32
    if name == "7b":
        d, f, v, L = 4096, 11008, 32000, 32
        shapes = [(v, d)]
        for _ in range(L):
            shapes += [(d, d)] * 4 + [(f, d), (f, d), (d, f), (d,), (d,)]
        shapes += [(d,), (v, d)]
        return shapes, torch.bfloat16
    d, f, v, L, E = 2048, 768, 151936, 24, 128
    shapes = [(v, d)]
    for _ in range(L):
        shapes += [(d, d)] * 4 + [(d,), (d,), (E, d)]
        for _ in range(E):
            shapes += [(f, d), (f, d), (d, f)]
    shapes += [(d,), (v, d)]
    return shapes, torch.bfloat16


def make(torch, shapes, dtype, fill):
    return [torch.full(s, fill, dtype=dtype, device="cuda") for s in shapes]


def named(tensors):
    return {f"t{i}": t for i, t in enumerate(tensors)}


def consumer(plugin, lib, method, name, q_in, q_out, rounds):
    torch = setup(plugin, lib)
    from tensormem_torch import weights
    shapes, dtype = layout(torch, name)
    if method == "tm_open":
        times = []
        for _ in range(rounds):
            payload = q_in.get()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            sub = weights.Subscriber(payload)
            times.append(time.perf_counter() - t0)
            sub.close()
        q_out.put(times)
        return
    params = named(make(torch, shapes, dtype, 0.0))
    last = params[f"t{len(shapes) - 1}"]
    torch.cuda.synchronize()
    q_out.put("ready")
    sub = weights.Subscriber(q_in.get())
    sub.prepare(params)
    q_out.put("opened")
    how = method[len("tm_"):]
    for _ in range(rounds):
        sub.install(params, method=how, timeout=600)
        q_out.put(float(last.view(-1)[0]))
    sub.close()


def run(torch, args, name, method, rounds):
    import torch.multiprocessing as mp
    from tensormem_torch import weights
    shapes, dtype = layout(torch, name)
    tensors = make(torch, shapes, dtype, 1.0)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    torch.cuda.synchronize()
    times = []
    if method == "floor":
        dst = make(torch, shapes, dtype, 0.0)
        for _ in range(rounds + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            torch._foreach_copy_(dst, tensors)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        del dst
    else:
        pub = weights.Publisher(named(tensors))
        ctx = mp.get_context("spawn")
        q_in, q_out = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=consumer, args=(args.plugin, args.lib, method, name, q_in, q_out, rounds + 1))
        p.start()
        if method == "tm_open":
            for _ in range(rounds + 1):
                q_in.put(pub.message())
            times = q_out.get()
        else:
            assert q_out.get() == "ready"
            for r in range(rounds + 1):
                tensors[-1].fill_(float(r + 2))
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                if r == 0:
                    # The first sync includes the message, the consumer's open and its plan.
                    q_in.put(pub.message())
                    assert q_out.get() == "opened"
                v = pub.publish()
                pub.wait_installed(v, timeout=600)
                times.append(time.perf_counter() - t0)
                got = q_out.get()
                assert got == float(r + 2), (got, r)
        p.join()
        pub.close(timeout=600)
    print(f"{name},{method},{len(shapes)},{nbytes},{times[0] * 1e3:.1f},{statistics.median(times[1:]) * 1e3:.2f}",
          flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("which", nargs="?", default="all", choices=("gpt2", "7b", "moe", "all"))
    ap.add_argument("rounds", nargs="?", type=int, default=3)
    ap.add_argument("--plugin", action="store_true", help="producer and consumer on tensormem's allocator")
    ap.add_argument("--lib")
    ap.add_argument("--methods", default=",".join(METHODS))
    args = ap.parse_args()
    methods = [m for m in args.methods.split(",") if m]
    unknown = set(methods) - set(METHODS)
    if unknown:
        ap.error(f"unknown methods {sorted(unknown)}: choose from {', '.join(METHODS)}")
    if args.rounds < 1:
        ap.error("ROUNDS must be at least 1 (the first sync is reported apart from the median of the others)")
    # Memory of expandable segments has no CUDA IPC memory handle: publish from ordinary segments.
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "TENSORMEM_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        os.environ.pop(var, None)
    torch = setup(args.plugin, args.lib)
    print("layout,method,tensors,bytes,first_ms,median_ms")
    for name in (["gpt2", "7b", "moe"] if args.which == "all" else [args.which]):
        for method in methods:
            run(torch, args, name, method, args.rounds)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

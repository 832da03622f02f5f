"""Benchmark: PyTorch programs on its native allocator and on tensormem's, alternated in one call.

    python3 alloc_bench.py [--lib PATH/libtensormem_torch.so] [--rounds 5] [--threads 1,2,4,8]

Each round runs native then tensormem, each in a fresh process (ABAB...): a ResNet-18 step with AMP and
GradScaler (batch 64, 96x96, channels_last), a transformer step with variable lengths and activation
checkpointing, an eager loop of small ops, and inference from several Python threads at once, each on
its own stream. Per process the figure is the median of the timed repetitions; over rounds the script
prints the median per backend, the ratio tensormem / native (below 1: tensormem faster) and the spread
(max/min over rounds) of each backend. Rows are CSV: `alloc_bench,WHAT,...`.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# The scripts beside this one; in a checkout, the package in the crate's python/ (else the installed one).
PACKAGE_ROOT = os.path.normpath(os.path.join(HERE, "..", "..", "python"))
sys.path.insert(0, HERE)
if os.path.isdir(os.path.join(PACKAGE_ROOT, "tensormem_torch")):
    sys.path.insert(1, PACKAGE_ROOT)


def timed(fn, reps, warmup=3):
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def cnn_step(torch):
    import torchvision
    model = torchvision.models.resnet18(num_classes=100).cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda")
    x = torch.randn(64, 3, 96, 96, device="cuda").to(memory_format=torch.channels_last)
    y = torch.randint(0, 100, (64,), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return timed(step, 60)


def transformer_step(torch):
    from torch.utils.checkpoint import checkpoint
    layer = torch.nn.TransformerEncoderLayer(512, 8, 2048, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 6).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    lengths = iter([64, 256, 128, 384, 96, 512, 200, 300] * 100)

    def step():
        h = torch.randn(16, next(lengths), 512, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            for block in model.layers:
                h = checkpoint(block, h, use_reentrant=False)
            loss = h.float().pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return timed(step, 48)


def small_ops(torch):
    a = torch.randn(256, 256, device="cuda")

    def loop():
        x = a
        for _ in range(2000):
            x = (x * 1.0001 + 0.5).relu_()
    return timed(loop, 5, warmup=1)


def threaded_inference(torch, threads, iters=1000):
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).cuda().eval()
    streams = [torch.cuda.Stream() for _ in range(threads)]
    barrier = threading.Barrier(threads + 1)

    def worker(stream):
        x = torch.randn(32, 256, device="cuda")
        barrier.wait()
        with torch.no_grad(), torch.cuda.stream(stream):
            for _ in range(iters):
                y = model(x)
                z = torch.cat([y, y]).softmax(-1)
                del y, z
        stream.synchronize()

    pool = [threading.Thread(target=worker, args=(s,)) for s in streams]
    for t in pool:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in pool:
        t.join()
    return threads * iters / (time.perf_counter() - t0)


def child(backend, lib, threads):
    if backend == "tensormem":
        import tensormem_torch
        tensormem_torch.install(lib, mode="native")
    import torch
    torch.backends.cudnn.benchmark = False
    out = {"cnn_step_ms": cnn_step(torch) * 1e3, "transformer_step_ms": transformer_step(torch) * 1e3,
           "small_ops_ms": small_ops(torch) * 1e3}
    for n in threads:
        threaded_inference(torch, n, iters=100)
        out[f"threads{n}_iters_per_s"] = statistics.median(threaded_inference(torch, n) for _ in range(3))
    out["device"] = torch.cuda.get_device_name()
    out["torch"] = torch.__version__
    out["allocator"] = torch.cuda.memory.get_allocator_backend()
    print("result," + json.dumps(out), flush=True)


def run(backend, lib, threads):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", backend, "--threads", ",".join(map(str, threads))]
    if lib:
        cmd += ["--lib", lib]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    rows = [line[7:] for line in proc.stdout.splitlines() if line.startswith("result,")]
    if proc.returncode != 0 or not rows:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"alloc_bench: the {backend} run failed (exit {proc.returncode})")
    return json.loads(rows[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", default="1,2,4,8")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    threads = [int(n) for n in args.threads.split(",") if n]
    if args.child:
        child(args.child, args.lib, threads)
        return
    results = {"native": [], "tensormem": []}
    for _ in range(args.rounds):
        for backend in ("native", "tensormem"):
            results[backend].append(run(backend, args.lib, threads))
    first = results["tensormem"][0]
    print(f"alloc_bench,device,{first['device']},torch {first['torch']},rounds {args.rounds}")
    for metric in [k for k in first if k not in ("device", "torch", "allocator")]:
        native = [r[metric] for r in results["native"]]
        ours = [r[metric] for r in results["tensormem"]]
        n, o = statistics.median(native), statistics.median(ours)
        print(f"alloc_bench,{metric},native {n:.3f},tensormem {o:.3f},ratio {o / n:.3f},"
              f"spread native {max(native) / min(native):.3f},spread tensormem {max(ours) / min(ours):.3f}")


if __name__ == "__main__":
    main()

"""Checks `tensormem replay --config X` (what the same run would have done under settings X) against the
run made under X for real, on a GPU machine with PyTorch.

    python3 benches/gpu/whatif_check.py OUTDIR --tensormem PATH/TO/tensormem [NAME ...]

Each workload is recorded once under every configuration of CONFIGS, each in a fresh Python process with
PYTORCH_CUDA_ALLOC_CONF set (OUTDIR/NAME__CONFIG.pickle and .stats.json, as
record_fidelity_traces.py writes them). Then the run under PyTorch's defaults is replayed under every
other configuration (`tensormem replay BASE.pickle --config X --json`) and each figure of the replayed
`memory_stats()` is compared with the figure PyTorch reported for the real run under X.

A what-if answer can only be exact where the program asked for the same sizes in the same order under
both configurations: the script compares the two recorded request sequences and says where they differ
(an out-of-memory error changed the program's path, or the program itself is not deterministic) instead
of counting such a run as a miss. It prints one row per (workload, configuration) and writes
OUTDIR/whatif.json with every mismatch.
"""
import concurrent.futures
import json
import os
import pickle
import random
import subprocess
import sys
import time

MIB = 1 << 20
CHILD_TIMEOUT = 120
# Runs recorded at once (each a fresh process on the same device).
PARALLEL = 5

# The configurations each workload runs under; the first is the base the others are answered from.
CONFIGS = [
    "",
    "expandable_segments:True",
    "max_split_size_mb:64",
    "roundup_power2_divisions:4",
    "garbage_collection_threshold:0.6",
]

# Figures of memory_stats() that are not the allocator's decisions (the settings themselves).
NOT_DECISIONS = {"max_split_size"}


def transformer_step(torch):
    """Three training steps of a small transformer encoder (bf16 autocast, AdamW)."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True, device="cuda")
    model = torch.nn.TransformerEncoder(layer, 6).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(8, 256, 512, device="cuda")
    for _ in range(3):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()


def varlen_inference(torch):
    """Inference over 40 batches of random sequence lengths (a fixed seed: the same lengths every run)."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True, device="cuda")
    model = torch.nn.TransformerEncoder(layer, 4).cuda().eval()
    rng = random.Random(5)
    with torch.no_grad():
        for _ in range(40):
            x = torch.randn(rng.randint(1, 16), rng.randint(16, 512), 512, device="cuda")
            model(x)
    torch.cuda.synchronize()


def graph_capture(torch):
    """An MLP training step captured with torch.cuda.graph and replayed, then eager allocations."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)
    ).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(256, 1024, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            model(x).pow(2).mean().backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        model(x).pow(2).mean().backward()
        opt.step()
    for _ in range(5):
        graph.replay()
    rng = random.Random(6)
    kept = [torch.empty(rng.randint(1, 30) * MIB + 999, dtype=torch.uint8, device="cuda") for _ in range(50)]
    del kept
    torch.cuda.synchronize()


def under_fraction(torch):
    """Random allocations under a memory fraction; out-of-memory errors caught (the program's path
    then depends on the configuration wherever an error moves)."""
    torch.cuda.set_per_process_memory_fraction(0.004)
    rng = random.Random(7)
    live = []
    for _ in range(200):
        size = rng.randint(1, 48) * MIB - rng.randint(0, 4095)
        try:
            live.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError:
            live.clear()
        if len(live) > 12 or (live and rng.random() < 0.3):
            live.pop(rng.randrange(len(live)))
    torch.cuda.synchronize()


WORKLOADS = {
    "transformer_step": transformer_step,
    "varlen_inference": varlen_inference,
    "graph_capture": graph_capture,
    "under_fraction": under_fraction,
}


def file_name(name, config):
    suffix = config.replace(":", "-").replace(",", "_") if config else "default"
    return f"{name}__{suffix}"


def record_one(name, config, out):
    import torch

    torch.cuda.init()
    torch.cuda.memory._record_memory_history(
        enabled="all", context=None, stacks="python", max_entries=10_000_000
    )
    WORKLOADS[name](torch)
    base = os.path.join(out, file_name(name, config))
    torch.cuda.memory._dump_snapshot(base + ".pickle")
    torch.cuda.memory._record_memory_history(enabled=None)
    stats = dict(torch.cuda.memory_stats(0))
    stats["alloc_conf"] = config
    with open(base + ".stats.json", "w") as f:
        json.dump(stats, f, indent=1, sort_keys=True)


def requests(path, actions=("alloc", "free_requested", "oom")):
    """The program's requests in a recorded trace: (action, size) of every event of `actions`."""
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    trace = snapshot["device_traces"][0]
    return [(e["action"], e["size"]) for e in trace if e["action"] in actions]


def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i, x, y
    if len(a) != len(b):
        return min(len(a), len(b)), None, None
    return None


def compare(tensormem, out, name, config):
    base = os.path.join(out, file_name(name, CONFIGS[0]))
    if not os.path.exists(base + ".pickle"):
        base = os.path.join(out, name)  # the repository's traces name the default run NAME
    real = os.path.join(out, file_name(name, config))
    result = subprocess.run(
        [tensormem, "replay", base + ".pickle", "--config", config, "--json"],
        capture_output=True, text=True, timeout=CHILD_TIMEOUT,
    )
    if result.returncode != 0:
        return {"error": result.stderr.strip()}
    replayed = json.loads(result.stdout)["runs"][1]["stats"]
    with open(real + ".stats.json") as f:
        expected = json.load(f)
    mismatches = {
        key: {"replayed": replayed[key], "real": value}
        for key, value in expected.items()
        if key in replayed and isinstance(value, int) and key not in NOT_DECISIONS
        and replayed[key] != value
    }
    compared = sum(
        1 for key, value in expected.items()
        if key in replayed and isinstance(value, int) and key not in NOT_DECISIONS
    )
    difference = first_difference(requests(base + ".pickle"), requests(real + ".pickle"))
    sizes = ("alloc", "oom")
    sizes_differ = first_difference(requests(base + ".pickle", sizes), requests(real + ".pickle", sizes))
    return {
        "compared": compared,
        "mismatches": mismatches,
        "same_requests": difference is None,
        "requests_differ_at": None if difference is None else list(difference),
        "same_sizes": sizes_differ is None,
        "sizes_differ_at": None if sizes_differ is None else list(sizes_differ),
    }


def main():
    if len(sys.argv) >= 5 and sys.argv[1] == "--one":
        record_one(sys.argv[2], sys.argv[3], sys.argv[4])
        return
    args = sys.argv[1:]
    if len(args) < 3 or args[1] != "--tensormem":
        sys.exit(f"usage: {sys.argv[0]} OUTDIR --tensormem PATH [NAME ...]   (names: {', '.join(WORKLOADS)})")
    out, tensormem, names = args[0], args[2], args[3:] or list(WORKLOADS)
    os.makedirs(out, exist_ok=True)
    began = time.time()

    def record(job):
        name, config = job
        env = dict(os.environ)
        env.pop("PYTORCH_ALLOC_CONF", None)
        env["PYTORCH_CUDA_ALLOC_CONF"] = config
        subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--one", name, config, out],
            env=env, timeout=CHILD_TIMEOUT, check=True,
        )

    # Each run is its own process with its own allocator: they share the device, not their figures.
    jobs = [(name, config) for name in names for config in CONFIGS]
    with concurrent.futures.ThreadPoolExecutor(PARALLEL) as pool:
        list(pool.map(record, jobs))
    print(f"recorded {len(jobs)} runs in {time.time() - began:.0f} s")
    results = {}
    print(f"{'workload':<18} {'configuration':<34} {'figures':>7} {'mismatches':>10}  requests")
    for name in names:
        for config in CONFIGS[1:]:
            r = compare(tensormem, out, name, config)
            results[f"{name} {config}"] = r
            if "error" in r:
                print(f"{name:<18} {config:<34} replay failed: {r['error']}")
                continue
            if r["same_requests"]:
                same = "same"
            elif r["same_sizes"]:
                same = f"same sizes, frees reordered from request {r['requests_differ_at'][0]}"
            else:
                same = f"sizes differ from allocation {r['sizes_differ_at'][0]}"
            print(f"{name:<18} {config:<34} {r['compared']:>7} {len(r['mismatches']):>10}  {same}")
            for key, v in list(r["mismatches"].items())[:4]:
                print(f"    {key}: replayed {v['replayed']}, real {v['real']}")
    with open(os.path.join(out, "whatif.json"), "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
    print(f"checked in {time.time() - began:.0f} s; details in {os.path.join(out, 'whatif.json')}")


if __name__ == "__main__":
    main()

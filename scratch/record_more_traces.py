"""Held-back traces for the replay bar: CUDA graph capture (private pools), an explicit MemPool, and two GPUs.
Run on the GPU machine: OUT=dir python3 record_hidden_traces.py NAME [CONF]. Writes NAME.pickle and NAME.stats.json
(top level = device 0's memory_stats subset; "devices" = every device's)."""
import json, os, random, sys, time
import torch

OUT = os.environ.get("OUT", "/tmp/traces")
os.makedirs(OUT, exist_ok=True)


def cudagraph_train():
    N, D_in, H, D_out = 640, 4096, 2048, 1024
    model = torch.nn.Sequential(torch.nn.Linear(D_in, H), torch.nn.Dropout(p=0.2),
                                torch.nn.Linear(H, D_out), torch.nn.Dropout(p=0.1)).cuda()
    loss_fn = torch.nn.MSELoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    static_input = torch.randn(N, D_in, device="cuda")
    static_target = torch.randn(N, D_out, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            loss_fn(model(static_input), static_target).backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(g):
        static_loss = loss_fn(model(static_input), static_target)
        static_loss.backward()
        opt.step()
    for _ in range(10):
        static_input.copy_(torch.randn(N, D_in, device="cuda"))
        static_target.copy_(torch.randn(N, D_out, device="cuda"))
        g.replay()
    torch.cuda.synchronize()
    del g, static_loss
    keep = []
    rng = random.Random(3)
    for i in range(300):
        keep.append(torch.empty(rng.randint(1, 1 << 24), dtype=torch.uint8, device="cuda"))
        if len(keep) > 24:
            keep.pop(rng.randrange(len(keep)))
    torch.cuda.synchronize()


def mempool():
    rng = random.Random(5)
    pool = torch.cuda.MemPool()
    eager, pooled = [], []
    for i in range(400):
        if i % 3 == 0:
            with torch.cuda.use_mem_pool(pool):
                pooled.append(torch.empty(rng.randint(1, 1 << 23), dtype=torch.uint8, device="cuda"))
        else:
            eager.append(torch.empty(rng.randint(1, 1 << 23), dtype=torch.uint8, device="cuda"))
        if len(eager) > 20:
            eager.pop(rng.randrange(len(eager)))
        if len(pooled) > 10:
            pooled.pop(rng.randrange(len(pooled)))
    torch.cuda.synchronize()
    del pooled
    torch.cuda.synchronize()


def two_gpu():
    rng = random.Random(11)
    live = {0: [], 1: []}
    for i in range(600):
        d = rng.choice([0, 1])
        t = torch.empty(rng.randint(1, 1 << 23), dtype=torch.uint8, device=f"cuda:{d}")
        live[d].append(t)
        if i % 7 == 0 and live[1 - d]:
            src = live[1 - d][-1]
            live[d].append(src.to(f"cuda:{d}"))
        for k in (0, 1):
            if len(live[k]) > 18:
                live[k].pop(rng.randrange(len(live[k])))
    for k in (0, 1):
        torch.cuda.synchronize(k)




def cudagraph_same_stream():
    N, D_in, H, D_out = 384, 2048, 3072, 512
    model = torch.nn.Sequential(torch.nn.Linear(D_in, H), torch.nn.ReLU(), torch.nn.Linear(H, D_out)).cuda()
    loss_fn = torch.nn.MSELoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    static_input = torch.randn(N, D_in, device="cuda")
    static_target = torch.randn(N, D_out, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            loss_fn(model(static_input), static_target).backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(s)
    graphs = []
    for k in range(2):
        g = torch.cuda.CUDAGraph()
        opt.zero_grad(set_to_none=True)
        with torch.cuda.graph(g, stream=s):
            static_loss = loss_fn(model(static_input), static_target)
            static_loss.backward()
            opt.step()
        graphs.append((g, static_loss))
    for _ in range(5):
        for g, _ in graphs:
            g.replay()
    torch.cuda.synchronize()
    del graphs, g, static_loss
    opt.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    keep = []
    rng = random.Random(9)
    for i in range(200):
        keep.append(torch.empty(rng.randint(1, 1 << 24), dtype=torch.uint8, device="cuda"))
        if len(keep) > 16:
            keep.pop(rng.randrange(len(keep)))
    torch.cuda.synchronize()


def mempool_kept():
    rng = random.Random(8)
    pool = torch.cuda.MemPool()
    eager, pooled = [], []
    for i in range(300):
        if i % 2 == 0:
            with torch.cuda.use_mem_pool(pool):
                pooled.append(torch.empty(rng.randint(1, 1 << 23), dtype=torch.uint8, device="cuda"))
        else:
            eager.append(torch.empty(rng.randint(1, 1 << 23), dtype=torch.uint8, device="cuda"))
        if len(eager) > 12:
            eager.pop(rng.randrange(len(eager)))
        if len(pooled) > 12:
            pooled.pop(rng.randrange(len(pooled)))
        if i == 150:
            torch.cuda.empty_cache()
    torch.cuda.synchronize()
    global KEEP
    KEEP = (pool, pooled[:3])


def three_gpu_like():
    two_gpu()


WORKLOADS = {"cudagraph_train": cudagraph_train, "mempool": mempool, "two_gpu": two_gpu,
             "cudagraph_same_stream": cudagraph_same_stream, "mempool_kept": mempool_kept}



def subset(stats):
    return {k: v for k, v in stats.items() if k.endswith((".all.peak", ".all.current", ".all.allocated", ".all.freed"))
            or k in ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_ooms", "num_sync_all_streams")}


if __name__ == "__main__":
    name, conf = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "")
    if conf:
        torch.cuda.memory._set_allocator_settings(conf)
    ndev = min(2, torch.cuda.device_count()) if name == "two_gpu" else 1
    torch.cuda.init()
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=10_000_000)
    t = time.time()
    WORKLOADS[name]()
    tag = name + ("__" + conf.replace(":", "-").replace(",", "_") if conf else "")
    torch.cuda.memory._dump_snapshot(os.path.join(OUT, tag + ".pickle"))
    torch.cuda.memory._record_memory_history(enabled=None)
    keep = subset(torch.cuda.memory_stats(0))
    keep["devices"] = {str(d): subset(torch.cuda.memory_stats(d)) for d in range(ndev)}
    keep["wall_s"] = time.time() - t
    keep["torch"] = torch.__version__
    keep["device"] = torch.cuda.get_device_name()
    keep["alloc_conf"] = conf
    with open(os.path.join(OUT, tag + ".stats.json"), "w") as f:
        json.dump(keep, f, indent=1, sort_keys=True)
    print(tag, {d: (v["reserved_bytes.all.peak"] >> 20, v["num_device_alloc"]) for d, v in keep["devices"].items()})

"""Records a PyTorch allocator trace under real memory pressure (retries, OOMs, empty_cache), for replay checks.
The GPU is filled with a raw cudaMalloc (CuPy) outside PyTorch's allocator, leaving a few GiB."""
import json, os, random, time
import torch, cupy
OUT = os.environ.get("OUT", "/tmp")
torch.cuda.init()  # no allocation before history starts: the trace must hold every event
free, total = torch.cuda.mem_get_info()
blocker = cupy.cuda.runtime.malloc(free - (3 << 30))
torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=10_000_000)
rng = random.Random(3)
live, ooms = [], 0
t = time.time()
for i in range(3000):
    n = int(2 ** rng.uniform(9, 29.5))
    try:
        live.append(torch.empty(n, dtype=torch.uint8, device="cuda"))
    except torch.cuda.OutOfMemoryError:
        ooms += 1
        live = live[len(live) // 2:]
    if len(live) > 24:
        live.pop(rng.randrange(len(live)))
    if i % 700 == 699:
        torch.cuda.empty_cache()
torch.cuda.synchronize()
torch.cuda.memory._dump_snapshot(os.path.join(OUT, "oom.pickle"))
torch.cuda.memory._record_memory_history(enabled=None)
stats = torch.cuda.memory_stats()
keep = {k: v for k, v in stats.items() if k.endswith((".all.peak", ".all.current", ".all.allocated", ".all.freed"))
        or k in ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_ooms", "num_sync_all_streams")}
keep.update(wall_s=time.time() - t, torch=torch.__version__, device=torch.cuda.get_device_name(), alloc_conf="")
json.dump(keep, open(os.path.join(OUT, "oom.stats.json"), "w"), indent=1, sort_keys=True)
print("python ooms", ooms, {k: keep[k] for k in ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free")})
cupy.cuda.runtime.free(blocker)

"""Times cudaMalloc / cudaFree of segment sizes the mixed pattern makes (2 MiB small-pool segments,
20 MiB and larger large-pool ones) through the CUDA runtime on the GPU host: the floor both allocators
pay for each new segment.

    python3 malloc_floor.py
"""
import ctypes
import glob
import time

import torch

torch.cuda.init()
candidates = sorted(glob.glob("/usr/local/cuda*/lib64/libcudart.so*"))
if not candidates:
    raise SystemExit("malloc_floor: no libcudart.so under /usr/local/cuda*/lib64")
rt = ctypes.CDLL(candidates[0])
ptr = ctypes.c_void_p()
for mib in (2, 20, 34, 64):
    times = []
    for _ in range(40):
        start = time.perf_counter_ns()
        if rt.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(mib << 20)) != 0:
            raise SystemExit(f"malloc_floor: cudaMalloc of {mib} MiB failed")
        times.append(time.perf_counter_ns() - start)
        rt.cudaFree(ptr)
    times.sort()
    print(f"cudaMalloc {mib} MiB: median {times[len(times) // 2] / 1000:.1f} us, "
          f"min {times[0] / 1000:.1f}, max {times[-1] / 1000:.1f} ({candidates[0]})")

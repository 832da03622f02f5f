"""PyTorch's memory_stats() under backend:cudaMallocAsync, to compare with AsyncAllocator::memory_stats.

Run on a GPU machine with torch installed:

    python3 crates/cuda-alloc/tests/python/async_stats.py

It sets PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync before importing torch, allocates 8 MiB,
and prints the keys of torch.cuda.memory_stats() that are nonzero: PyTorch fills only
allocated_bytes.all, active_bytes.all and reserved_bytes.all (current and peak) for this backend.
"""

import os

os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "backend:cudaMallocAsync"

import torch  # noqa: E402

assert torch.cuda.get_allocator_backend() == "cudaMallocAsync"
torch.cuda.empty_cache()
torch.cuda.reset_peak_memory_stats()
x = torch.empty(8 << 20, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
for when in ("allocated", "freed"):
    stats = torch.cuda.memory_stats()
    nonzero = {k: v for k, v in sorted(stats.items()) if v}
    print(f"{when}: {nonzero}")
    del x
    x = None
    torch.cuda.synchronize()

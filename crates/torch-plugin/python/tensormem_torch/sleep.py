"""Pools that sleep and wake: ``sleep(pool, keep_contents)`` and ``wake(pool)``.

A private pool -- a ``torch.cuda.MemPool``, or a CUDA graph's pool -- whose memory is on expandable
segments (``PYTORCH_CUDA_ALLOC_CONF`` / ``TENSORMEM_ALLOC_CONF`` ``expandable_segments:True``) can hand
its physical memory back to the device while its addresses stay reserved: its tensors keep their
``data_ptr()`` and a graph captured into it keeps its pointers. ``wake`` maps fresh memory at the same
addresses and, if ``keep_contents`` was set, copies the bytes back from host memory, after which the
tensors hold what they held and the graph replays as before. The backup goes into pinned host memory
cached for it (``reserve_backup_memory``, or an earlier backup) and, for the rest, through pinned
staging buffers into ordinary memory, which background threads move into pinned memory while the pool
sleeps::

    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        weights = torch.randn(4096, 4096, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool.id):
        out = weights @ weights
    tensormem_torch.sleep(pool, keep_contents=True)   # memory back to the device (mem_get_info)
    ...                                                # another workload uses the GPU
    tensormem_torch.wake(pool)                         # same addresses, same contents
    graph.replay()

While a pool sleeps, ``torch.cuda.memory_reserved()`` drops by the memory it returned (comes back on wake)
and ``torch.cuda.mem_get_info()`` shows that memory free; ``memory_allocated()`` does not change.
Refused (``RuntimeError`` naming why): a pool not on expandable segments, one with memory shared with
another process, one being captured or allocated to (``use_mem_pool``), a pool already asleep, waking a
pool that is not; allocating to a sleeping pool (``use_mem_pool``, a capture into it) fails too. Needs the
native install (``install(mode="native")``).

``tensormem_torch.sleep``, ``wake`` and ``is_asleep`` (from ``tensormem_torch.regions``) also take the tag
of a region; the functions here take pools.
"""
import ctypes

from ._paths import last_error, load_library

_LIB = None

_U64P = ctypes.POINTER(ctypes.c_uint64)
# The functions this module calls: argument types (each returns an int status).
_SIGNATURES = {
    "tensormem_pool_sleep": [ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int, _U64P],
    "tensormem_pool_wake": [ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, _U64P],
    "tensormem_host_empty_cache": [],
    "tensormem_host_reserve": [ctypes.c_int, ctypes.c_uint64, _U64P],
    "tensormem_pool_is_asleep": [ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64],
}


def _library():
    """libtensormem_torch.so with this module's functions (``_paths.load_library``), loaded once."""
    global _LIB
    if _LIB is None:
        _LIB = load_library(_SIGNATURES)
    return _LIB


def _pool_id(pool):
    """(first, second) of a torch.cuda.MemPool, a CUDAGraph (its pool) or a pool handle tuple."""
    if hasattr(pool, "id") and not isinstance(pool, tuple):
        pool = pool.id
    elif hasattr(pool, "pool") and callable(pool.pool):
        pool = pool.pool()
    first, second = pool
    return int(first), int(second)


def _device(device):
    import torch
    if device is None:
        return torch.cuda.current_device()
    return torch.device("cuda", device).index if isinstance(device, int) else torch.device(device).index


def _raise(lib, rc, what):
    message = f"tensormem: {what} failed: {last_error(lib)}"
    if rc == 1:
        import torch
        raise torch.OutOfMemoryError(message)
    raise RuntimeError(message)


def sleep(pool, keep_contents=True, device=None):
    """Releases the physical memory of ``pool`` (a MemPool, a CUDAGraph, or a pool id) on ``device``,
    keeping its addresses; with ``keep_contents`` its bytes go to host memory first (pinned where it is
    cached, else staged). Returns the bytes given back to the device."""
    lib = _library()
    first, second = _pool_id(pool)
    released = ctypes.c_uint64(0)
    rc = lib.tensormem_pool_sleep(_device(device), first, second, 1 if keep_contents else 0,
                                  ctypes.byref(released))
    if rc != 0:
        _raise(lib, rc, f"sleep(pool {(first, second)})")
    return released.value


def wake(pool, device=None, release_host_memory=False):
    """Maps fresh memory at the addresses of sleeping ``pool`` and copies its contents back if they were
    kept. Returns the bytes mapped. ``torch.OutOfMemoryError`` if the device has no room (the pool stays
    asleep). The pinned host memory of the backup stays cached for the next sleep (which then copies
    straight into it instead of staging); ``release_host_memory=True`` gives it back to the system
    after the wake instead."""
    lib = _library()
    first, second = _pool_id(pool)
    mapped = ctypes.c_uint64(0)
    rc = lib.tensormem_pool_wake(_device(device), first, second, ctypes.byref(mapped))
    if rc != 0:
        _raise(lib, rc, f"wake(pool {(first, second)})")
    if release_host_memory:
        release_host_memory_now()
    return mapped.value


def reserve_backup_memory(nbytes, device=None):
    """Pins ``nbytes`` of host memory for the backups of ``device``'s sleeping pools ahead of the first
    sleep (several threads at once) and keeps it cached: the first ``sleep(..., keep_contents=True)``
    then copies at once instead of pinning as it goes (pinning is what makes a first sleep slow). Returns
    the bytes cached. It takes as long as pinning does: call it while the program does other things (it
    releases the GIL), e.g. ``threading.Thread(target=reserve_backup_memory, args=(22 << 30,)).start()``
    while the model loads."""
    lib = _library()
    reserved = ctypes.c_uint64(0)
    rc = lib.tensormem_host_reserve(_device(device), int(nbytes), ctypes.byref(reserved))
    if rc != 0:
        _raise(lib, rc, f"reserving {int(nbytes)} bytes of pinned host memory")
    return reserved.value


def release_host_memory_now():
    """Gives the pinned host memory cached for backups (kept after a wake for the next sleep) back to the
    system."""
    lib = _library()
    rc = lib.tensormem_host_empty_cache()
    if rc != 0:
        _raise(lib, rc, "releasing the pinned host memory after wake")


def is_asleep(pool, device=None):
    """Whether ``pool`` is asleep."""
    lib = _library()
    first, second = _pool_id(pool)
    rc = lib.tensormem_pool_is_asleep(_device(device), first, second)
    if rc < 0:
        _raise(lib, rc, f"is_asleep(pool {(first, second)})")
    return bool(rc)

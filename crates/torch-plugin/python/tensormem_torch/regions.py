"""Tagged regions: allocations made inside ``with region("weights"):`` belong to one memory pool per tag
and device, which sleeps and wakes as a whole.

What serving stacks build their sleep modes on (vLLM's ``CuMemAllocator`` tags, SGLang's
``torch_memory_saver`` regions): the engine allocates its weights in one region and its KV cache in
another, captures its CUDA graphs over both, and between requests puts the GPU to sleep, keeping the
weights' bytes in pinned host memory and discarding the KV cache's::

    import tensormem_torch
    tensormem_torch.install()              # with expandable_segments:True (the pools must be on them)

    with tensormem_torch.region("weights"):
        model = build_model().cuda()
    with tensormem_torch.region("kv_cache"):
        cache = torch.empty(n_blocks, block_bytes, dtype=torch.uint8, device="cuda")
    ...                                    # capture CUDA graphs over model and cache

    tensormem_torch.sleep_regions(keep=["weights"], discard=["kv_cache"])   # memory back to the device
    ...                                    # training uses the GPU
    tensormem_torch.wake_regions()         # same addresses; the weights hold what they held
    graph.replay()

A region is a ``torch.cuda.MemPool`` made the first time its tag is used on a device and kept for the
process's life; ``with region(tag)`` is ``torch.cuda.use_mem_pool`` of it, so regions nest and graphs can
be captured into them. ``sleep`` and ``wake`` of this package take a tag as well as a pool. Several
devices sleep and wake at once, one thread per device (each call releases the GIL while it copies).
The pools are ordinary private pools of tensormem's allocator: what ``sleep`` refuses (a pool not on
expandable segments, one being allocated to, one already asleep) is refused for regions too, with the
tag in the message.
"""
import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor

from . import sleep as pools

_LOCK = threading.Lock()
_POOLS = {}  # (tag, device index) -> torch.cuda.MemPool


def _device_index(torch, device):
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def _check_tag(tag):
    if not isinstance(tag, str) or not tag:
        raise ValueError(f"a region's tag is a non-empty string such as \"weights\", not {tag!r}")


def pool_of(tag, device=None):
    """The pool of region ``tag`` on ``device`` (the current device when ``None``), made the first time."""
    import torch

    _check_tag(tag)
    index = _device_index(torch, device)
    with _LOCK:
        pool = _POOLS.get((tag, index))
        if pool is None:
            with torch.cuda.device(index):
                pool = torch.cuda.MemPool()
            _POOLS[(tag, index)] = pool
    return pool


@contextlib.contextmanager
def region(tag, device=None):
    """Allocations on ``device`` (the current device when ``None``) inside the ``with`` block go to region
    ``tag``'s pool. Yields the pool (a ``torch.cuda.MemPool``)."""
    import torch

    pool = pool_of(tag, device)
    with torch.cuda.use_mem_pool(pool, device=_device_index(torch, device)):
        yield pool


def regions(tag=None):
    """The regions made so far: ``{(tag, device): pool}``, only ``tag``'s when given."""
    with _LOCK:
        return {key: pool for key, pool in _POOLS.items() if tag is None or key[0] == tag}


def pools_of(tag, device=None):
    """``[(device, pool)]`` of region ``tag``: on ``device`` only when given, else on every device where it
    was made. ``KeyError`` naming the regions that exist when there is none."""
    _check_tag(tag)
    found = sorted(
        ((key[1], pool) for key, pool in regions(tag).items() if device is None or key[1] == device),
        key=lambda item: item[0],
    )
    if not found:
        known = sorted({key[0] for key in regions()})
        where = "" if device is None else f" on device {device}"
        raise KeyError(f"no region {tag!r}{where} (regions made so far: {known}); allocate in it first "
                       f"with tensormem_torch.region({tag!r})")
    return found


def _each_device(calls):
    """Runs ``calls`` (``[(device, function)]``), the devices at once; returns ``{device: result}`` after
    every call ended, raising the first failure (by device order) once all are done."""
    by_device = {}
    for device, call in calls:
        by_device.setdefault(device, []).append(call)

    def run_all(device_calls):
        return [call() for call in device_calls]

    if len(by_device) <= 1:
        return {device: run_all(c) for device, c in by_device.items()}
    with ThreadPoolExecutor(max_workers=len(by_device)) as pool:
        futures = {device: pool.submit(run_all, c) for device, c in sorted(by_device.items())}
    results, first_error = {}, None
    for device, future in futures.items():
        try:
            results[device] = future.result()
        except Exception as error:  # every device is tried; the first failure is raised
            if first_error is None:
                first_error = error
    if first_error is not None:
        raise first_error
    return results


def sleep_regions(keep=(), discard=(), device=None):
    """Puts regions to sleep: those named in ``keep`` with their contents (copied to host memory),
    those in ``discard`` without. On ``device`` only when given, else on every device where each exists,
    the devices at once. Returns ``{(tag, device): bytes given back}``."""
    if isinstance(keep, str) or isinstance(discard, str):
        raise TypeError("keep and discard are lists of tags, e.g. keep=[\"weights\"]")
    both = set(keep) & set(discard)
    if both:
        raise ValueError(f"regions {sorted(both)} are both kept and discarded")
    calls, keys = [], []
    for tags, contents in ((keep, True), (discard, False)):
        for tag in tags:
            for index, pool in pools_of(tag, device):
                keys.append((tag, index))
                calls.append((index, lambda p=pool, i=index, c=contents: pools.sleep(p, c, i)))
    done = _each_device(calls)
    return _by_key(calls, keys, done)


def wake_regions(tags=None, device=None, release_host_memory=False):
    """Wakes the sleeping regions ``tags`` (every sleeping region when ``None``) on ``device`` (every device
    when ``None``), the devices at once. Returns ``{(tag, device): bytes mapped}``."""
    if isinstance(tags, str):
        tags = [tags]
    if tags is None:
        chosen = [(key, pool) for key, pool in sorted(regions().items(), key=lambda kv: kv[0])
                  if (device is None or key[1] == device) and pools.is_asleep(pool, key[1])]
    else:
        chosen = [((tag, index), pool) for tag in tags for index, pool in pools_of(tag, device)]
    calls = [(key[1], lambda p=pool, i=key[1]: pools.wake(p, i)) for key, pool in chosen]
    keys = [key for key, _ in chosen]
    done = _each_device(calls)
    if release_host_memory and chosen:
        pools.release_host_memory_now()
    return _by_key(calls, keys, done)


def _by_key(calls, keys, done):
    """The results of ``_each_device`` by the key of each call (calls of one device run in order)."""
    seen = {}
    out = {}
    for (device, _), key in zip(calls, keys):
        position = seen.get(device, 0)
        seen[device] = position + 1
        out[key] = done[device][position]
    return out


def _tagged(tag, device, call):
    """``call(pool, device)`` for each pool of region ``tag``, the devices at once; the sum."""
    done = _each_device([(index, lambda p=p, i=index: call(p, i)) for index, p in pools_of(tag, device)])
    return sum(sum(results) for results in done.values())


def sleep(pool, keep_contents=True, device=None):
    """Releases the physical memory of ``pool`` on ``device``, keeping its addresses; with
    ``keep_contents`` its bytes go to host memory first. ``pool`` is a ``torch.cuda.MemPool``, a
    ``CUDAGraph`` (its pool), a pool id, or a region's tag (its pools on ``device``, or on every device
    where it was made, at once). Returns the bytes given back to the device."""
    if isinstance(pool, str):
        return _tagged(pool, device, lambda p, i: pools.sleep(p, keep_contents, i))
    return pools.sleep(pool, keep_contents, device)


def wake(pool, device=None, release_host_memory=False):
    """Maps fresh memory at the addresses of sleeping ``pool`` (as for ``sleep``, a region's tag too) and
    copies its contents back if they were kept. Returns the bytes mapped. ``torch.OutOfMemoryError`` if
    the device has no room (the pool stays asleep). The pinned host memory of the backup stays cached for
    the next sleep; ``release_host_memory=True`` gives it back to the system after the wake."""
    if isinstance(pool, str):
        mapped = _tagged(pool, device, lambda p, i: pools.wake(p, i))
        if release_host_memory:
            pools.release_host_memory_now()
        return mapped
    return pools.wake(pool, device, release_host_memory)


def is_asleep(pool, device=None):
    """Whether ``pool`` is asleep (a region's tag: every pool of it on ``device``, or everywhere)."""
    if isinstance(pool, str):
        return all(pools.is_asleep(p, i) for i, p in pools_of(pool, device))
    return pools.is_asleep(pool, device)

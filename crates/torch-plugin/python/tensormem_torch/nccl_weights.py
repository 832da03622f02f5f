"""A model's weights from one rank into the other ranks' own tensors through NCCL, version after version.

An RL trainer sends its weights to inference engines on other GPUs, or other machines, after every optimizer
step; the engines keep their own parameters (their CUDA graphs read those addresses) and want the new values
copied in. Every process is a rank with its own GPU and its own tensors; rank ``src`` (the trainer) sends::

    store = torch.distributed.TCPStore(host, port, world_size, is_master=(rank == 0))
    with tensormem_torch.nccl_weights.NcclWeights(model.state_dict(), rank, world_size, store=store) as w:
        while training:
            if rank == 0:
                step()                # writes the weights in place, on the current stream
            w.sync()                  # rank 0 sends; on return the others' tensors hold the new values

Connecting (the constructor, on every rank, with the same ``world_size``, ``src`` and ``bucket_bytes``) makes an
NCCL communicator of the ranks and checks the layouts: the sender's tensors (names, dtypes, shapes) against each
rank's, matched by name in any order; a difference is a ``NcclWeightsError`` on every rank, naming it on the rank
that differs, before any weight moves. Each ``sync()`` broadcasts the sender's tensors in buckets of
``bucket_bytes`` through two staging buffers per rank registered with the communicator, packing and unpacking
pipelined with the transfers (``tensormem_nccl::weights``; see docs/nccl.md).

NCCL needs an id made by one rank and given to every rank. Without ``unique_id``, rank ``src`` makes it and shares
it through ``store`` (a ``torch.distributed`` ``TCPStore`` or ``FileStore`` every rank reaches; by default the
default process group's store), where every rank also says whether its own tensors were accepted, so that a rank
that refuses its arguments makes every rank raise instead of leaving the others waiting for it. Every rank makes
its ``NcclWeights`` objects in the same order (or passes the same ``key``). With ``unique_id`` (the bytes of
``unique_id()`` made on rank ``src``, sent by any means), no store is used.

The sync moves bytes: the tensors must be contiguous CUDA tensors of one device, the ones the program keeps using
(a ``.contiguous()`` copy would not be the parameter). NCCL's own library is loaded on first use; PyTorch's wheels
ship it under a name the library does not look for (``libnccl.so.2``): ``nccl_library_dir()`` makes a directory
with a ``libnccl.so`` link to it, for ``LD_LIBRARY_PATH`` of the processes that sync (set before they start;
``torch.multiprocessing`` children started after ``os.environ`` changed inherit it). The library is loaded with
ctypes (``tensormem_torch.find_library()``); no torch is imported until a function is called.
"""
import collections
import ctypes
import hashlib
import os
import re

from ._paths import last_error, load_library
from .weights import _dtype_name, _named

__all__ = ["NcclWeights", "NcclWeightsError", "SyncReport", "unique_id", "nccl_library_dir", "UNIQUE_ID_BYTES",
           "DEFAULT_BUCKET_BYTES", "MIN_BUCKET_BYTES"]

# src/status.rs and src/nccl_weights.rs (csrc/tensormem_abi.h).
TM_OK = 0
TM_OUT_OF_MEMORY = 1
UNIQUE_ID_BYTES = 128
DEFAULT_BUCKET_BYTES = 256 << 20
MIN_BUCKET_BYTES = 1 << 20

_LIB = None
# Per rank, the NcclWeights this process made through a store: the default key of the next one (per rank, so that
# ranks driven from one process keep in step too).
_MADE = collections.Counter()


class NcclWeightsError(RuntimeError):
    """A weight sync call failed, or another rank refused; the message says what and what to do."""


SyncReport = collections.namedtuple("SyncReport", "sync bytes buckets direct seconds")
SyncReport.__doc__ = """What one sync moved, as this rank saw it: the sync's number (from 1), the bytes of all tensors,
the broadcasts, those sent from or into a tensor directly (no staging copy), and the seconds it took."""


class _Report(ctypes.Structure):
    """TmNcclSyncReport."""
    _fields_ = [("sync", ctypes.c_uint64), ("bytes", ctypes.c_uint64), ("buckets", ctypes.c_uint64),
                ("direct", ctypes.c_uint64), ("seconds", ctypes.c_double)]


_P = ctypes.c_void_p
_U64P = ctypes.POINTER(ctypes.c_uint64)
_STRS = ctypes.POINTER(ctypes.c_char_p)
_SIGNATURES = {
    "tensormem_nccl_unique_id": [ctypes.c_void_p, ctypes.c_size_t],
    "tensormem_nccl_weights_open": [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                    ctypes.c_int, ctypes.c_size_t, _STRS, _U64P, _U64P, _STRS, ctypes.c_size_t,
                                    ctypes.c_uint64, ctypes.POINTER(_P)],
    "tensormem_nccl_weights_sync": [_P, _P, ctypes.POINTER(_Report)],
    "tensormem_nccl_weights_close": [_P],
}


def _library():
    """libtensormem_torch.so with this module's functions (``_paths.load_library``), loaded once."""
    global _LIB
    if _LIB is None:
        _LIB = load_library(_SIGNATURES)
    return _LIB


def _ok(rc, what):
    if rc == TM_OK:
        return
    text = last_error(_library())
    message = f"tensormem nccl_weights: {what} failed: {text}"
    if "NCCL could not be loaded" in text:
        here = nccl_library_dir()
        if here:
            message += f" (here: start the processes with LD_LIBRARY_PATH={here}:$LD_LIBRARY_PATH)"
    if rc == TM_OUT_OF_MEMORY:
        import torch
        raise torch.OutOfMemoryError(message)
    raise NcclWeightsError(message)


def unique_id():
    """A new NCCL unique id (128 bytes), for ``NcclWeights(..., unique_id=...)`` on every rank. Make it on rank
    ``src``: it names a rendezvous at this process's address. Needs NCCL, not a GPU."""
    buf = (ctypes.c_uint8 * UNIQUE_ID_BYTES)()
    _ok(_library().tensormem_nccl_unique_id(buf, UNIQUE_ID_BYTES), "unique_id")
    return bytes(buf)


def _loaded_nccl():
    """The path of an NCCL library mapped into this process (PyTorch's, once torch is imported), or None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(None, 5)[-1].strip()
                if re.search(r"/libnccl\.so(\.[0-9]+)*$", path):
                    return path
    except OSError:
        pass
    try:
        import nvidia.nccl
        for folder in nvidia.nccl.__path__:
            path = os.path.join(folder, "lib", "libnccl.so.2")
            if os.path.isfile(path):
                return path
    except ImportError:
        pass
    return None


def nccl_library_dir():
    """A directory holding ``libnccl.so``, a link to PyTorch's NCCL (the one this process mapped, else the
    ``nvidia-nccl`` wheel's ``libnccl.so.2``), made once under ``$TENSORMEM_TORCH_CACHE`` (default
    ``~/.cache/tensormem_torch``); None where no NCCL is found. Put it on ``LD_LIBRARY_PATH`` of the processes
    that sync, before they start (the loader reads it at start-up)."""
    target = _loaded_nccl()
    if target is None:
        return None
    target = os.path.realpath(target)
    cache = os.environ.get("TENSORMEM_TORCH_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "tensormem_torch"))
    folder = os.path.join(cache, "nccl-" + hashlib.sha256(target.encode()).hexdigest()[:16])
    link = os.path.join(folder, "libnccl.so")
    if os.path.realpath(link) != target:
        os.makedirs(folder, exist_ok=True)
        temporary = f"{link}.{os.getpid()}"
        os.symlink(target, temporary)
        os.replace(temporary, link)
    return folder


def _timeout_ms(timeout):
    """``timeout`` in seconds (None: the default) as the milliseconds the library takes (0: its default)."""
    if timeout is None:
        return 0
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"tensormem nccl_weights: timeout is {timeout!r}; pass seconds, more than 0 (or None for "
                         "the default, ten minutes)")
    return max(1, int(timeout * 1000))


def _check_ranks(rank, world_size, src):
    for name, value in (("rank", rank), ("world_size", world_size), ("src", src)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"tensormem nccl_weights: {name} must be an int, not {type(value).__name__}")
    if world_size < 1:
        raise ValueError(f"tensormem nccl_weights: world_size is {world_size}; pass the number of processes, >= 1")
    for name, value in (("rank", rank), ("src", src)):
        if not 0 <= value < world_size:
            raise ValueError(f"tensormem nccl_weights: {name} {value} is not a rank of a world of {world_size} "
                             f"(0 to {world_size - 1})")


def _describe(torch, names, tensors, device):
    """This rank's device and the library's parallel arrays (kept alive by the caller while used)."""
    devices, seen = set(), set()
    for name, t in zip(names, tensors):
        if not isinstance(name, str):
            raise TypeError(f"tensormem nccl_weights: tensor names must be str, not {type(name).__name__}")
        if name in seen:
            raise ValueError(f"tensormem nccl_weights: two tensors are named {name!r}; names must be unique")
        seen.add(name)
        if not isinstance(t, torch.Tensor) or not t.is_cuda:
            raise ValueError(f"tensormem nccl_weights: {name!r} is not a CUDA tensor; sync CUDA tensors only")
        if not t.is_contiguous():
            raise ValueError(f"tensormem nccl_weights: {name!r} is not contiguous (shape {tuple(t.shape)}, stride "
                             f"{tuple(t.stride())}): the sync moves each tensor's bytes as they lie; pass contiguous "
                             "tensors, the ones the program keeps using (a .contiguous() copy is not the parameter)")
        devices.add(t.device.index)
    if device is not None:
        index = device if isinstance(device, int) else torch.device(device).index
        devices.add(torch.cuda.current_device() if index is None else index)
    if len(devices) > 1:
        raise ValueError(f"tensormem nccl_weights: the tensors (and device=) are on devices {sorted(devices)}; each "
                         "rank syncs the tensors of one device")
    device = devices.pop() if devices else torch.cuda.current_device()
    n = len(names)
    arrays = (n, (ctypes.c_char_p * n)(*[name.encode("utf-8") for name in names]),
              (ctypes.c_uint64 * n)(*[t.data_ptr() for t in tensors]),
              (ctypes.c_uint64 * n)(*[t.numel() * t.element_size() for t in tensors]),
              (ctypes.c_char_p * n)(*[f"{_dtype_name(t.dtype)}[{','.join(str(s) for s in t.shape)}]".encode()
                                      for t in tensors]))
    return device, arrays


def _default_store(torch):
    dist = getattr(torch, "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.distributed_c10d._get_default_store()
    raise ValueError("tensormem nccl_weights: no unique_id, no store and no default process group to share NCCL's "
                     "id through: pass store= (a torch.distributed.TCPStore or FileStore every rank reaches), "
                     "unique_id= (the bytes of nccl_weights.unique_id() made on rank src, sent to every rank), or "
                     "call torch.distributed.init_process_group first")


def _share_id(store, prefix, rank, world_size, src, error):
    """The id rank ``src`` made, through ``store``; every rank says there whether it accepted its arguments first,
    and raises if any did not (its own error on the rank that refused)."""
    made = None
    if rank == src and error is None:
        try:
            made = unique_id()
        except NcclWeightsError as e:
            error = e
    if made is not None:
        store.set(f"{prefix}/id", made)
    status = b"ok" if error is None else f"{type(error).__name__}: {error}".encode("utf-8", "replace")
    store.set(f"{prefix}/status/{rank}", status)
    if error is not None:
        raise error
    refusals = []
    for r in range(world_size):
        answer = bytes(store.get(f"{prefix}/status/{r}")) if r != rank else b"ok"
        if answer != b"ok":
            refusals.append(f"rank {r}: {answer.decode('utf-8', 'replace')}")
    if refusals:
        raise NcclWeightsError("tensormem nccl_weights: no rank connects, since another refused its arguments: "
                               + "; ".join(refusals))
    return made if made is not None else bytes(store.get(f"{prefix}/id"))


class NcclWeights:
    """This rank's end of a weight sync through NCCL (see the module's docs).

    ``named_tensors``: a mapping of names to this rank's contiguous CUDA tensors of one device (a ``state_dict()``)
    or (name, tensor) pairs; the sender's are sent, every other rank's written, matched by name. ``rank`` and
    ``world_size``: this process among the processes taking part; ``src``: the sending rank. ``unique_id``: the
    bytes of ``unique_id()`` from rank ``src``; without it, shared through ``store`` (default: the default process
    group's) under ``key`` (default: how many this process made so far for ``rank``). ``bucket_bytes``: the size of one
    broadcast, at least 1 MiB, the same on every rank; each rank holds two staging buffers of it. ``device``: the
    tensors' device (default: theirs, or the current device when there are none). ``timeout``: seconds this rank
    waits for the others in one exchange before it raises (a rank that died or stopped syncing), after which the
    sync is broken and ``close()`` aborts its communicator; default ten minutes, PyTorch's NCCL default.

    Returns once every rank connected and the layouts agree; raises ``NcclWeightsError`` naming the differences
    otherwise, on every rank. The tensors are kept referenced until ``close()``.
    """

    def __init__(self, named_tensors, rank, world_size, src=0, unique_id=None, store=None,
                 bucket_bytes=DEFAULT_BUCKET_BYTES, device=None, key=None, timeout=None):
        import torch
        self._handle = None
        _check_ranks(rank, world_size, src)
        names, tensors = _named(named_tensors)
        error = None
        try:
            if not isinstance(bucket_bytes, int) or bucket_bytes < MIN_BUCKET_BYTES:
                raise ValueError(f"tensormem nccl_weights: bucket_bytes is {bucket_bytes}; pass at least "
                                 f"{MIN_BUCKET_BYTES} (1 MiB), the same on every rank")
            timeout_ms = _timeout_ms(timeout)
            self.device, arrays = _describe(torch, names, tensors, device)
        except (TypeError, ValueError) as e:
            error = e
        if unique_id is None:
            if store is None:
                if error is not None:
                    raise error
                store = _default_store(torch)
            if key is None:
                key = str(_MADE[rank])
                _MADE[rank] += 1
            unique_id = _share_id(store, f"tensormem_nccl_weights/{key}", rank, world_size, src, error)
        elif error is not None:
            raise error
        unique_id = bytes(unique_id)
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise ValueError(f"tensormem nccl_weights: unique_id is {len(unique_id)} bytes, not {UNIQUE_ID_BYTES}: "
                             "pass the bytes of nccl_weights.unique_id() unchanged")
        handle = _P()
        _ok(_library().tensormem_nccl_weights_open(self.device, unique_id, len(unique_id), rank, world_size, src,
                                                   *arrays, bucket_bytes, timeout_ms, ctypes.byref(handle)), "open")
        self._handle = handle.value
        self.names, self._tensors = names, tensors
        self.rank, self.world_size, self.src = rank, world_size, src

    def _live(self):
        if self._handle is None:
            raise NcclWeightsError("tensormem nccl_weights: the sync is closed")
        return self._handle

    def sync(self, stream=None):
        """Moves the weights once; every rank calls it, once per version. On rank ``src`` its tensors' values as
        written by the work queued so far on ``stream`` (default: the device's current stream) are sent; on the
        others they are written into the tensors. Returns once done (the sender may write again; the others'
        tensors hold the new values), with a ``SyncReport``."""
        import torch
        stream = stream if stream is not None else torch.cuda.current_stream(self.device)
        report = _Report()
        _ok(_library().tensormem_nccl_weights_sync(self._live(), _P(stream.cuda_stream or None),
                                                   ctypes.byref(report)), "sync")
        return SyncReport(report.sync, report.bytes, report.buckets, report.direct, report.seconds)

    def close(self):
        """Frees the staging buffers and the communicator, and lets go of the tensors. Every rank closes its own."""
        handle, self._handle = getattr(self, "_handle", None), None
        self._tensors = None
        if handle is not None:
            _ok(_library().tensormem_nccl_weights_close(handle), "close")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        handle, self._handle = getattr(self, "_handle", None), None
        if handle is not None and _LIB is not None:
            _LIB.tensormem_nccl_weights_close(handle)

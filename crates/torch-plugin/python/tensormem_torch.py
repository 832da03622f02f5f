"""PyTorch on tensormem's CUDA caching allocator.

Loads ``libtensormem_torch.so`` (the ``tensormem-torch`` crate), builds PyTorch's
``torch.cuda.memory.CUDAPluggableAllocator`` from it with every optional hook this PyTorch accepts, and
either makes it PyTorch's allocator or wraps it in a ``torch.cuda.MemPool``. No install needed: put this
file on ``sys.path`` (or copy it beside your script).

    import tensormem_torch
    plugin = tensormem_torch.install()          # before the first CUDA allocation
    ...                                         # run the model as usual
    print(plugin.stats()["reserved_bytes.all.peak"])

``torch.cuda.memory_stats()`` does not work while a pluggable allocator is current; ``plugin.stats()``
returns tensormem's statistics under the same keys. The library is found at ``$TENSORMEM_TORCH_LIB``,
else beside this file, else in the workspace's ``target/release`` or ``target/debug``.
"""
import ctypes
import json
import os

__all__ = ["Plugin", "install", "mem_pool", "find_library", "HOOKS"]

LIB_NAME = "libtensormem_torch.so"

# (setter of PyTorch's _CUDAPluggableAllocator, the function of the library it is given)
HOOKS = (
    ("set_init_fn", "tensormem_init"),
    ("set_reset_fn", "tensormem_empty_cache"),
    ("set_memory_fraction_fn", "tensormem_set_memory_fraction"),
    ("set_base_alloc_fn", "tensormem_base_alloc"),
    ("set_record_stream_fn", "tensormem_record_stream"),
    ("set_begin_allocate_to_pool", "tensormem_begin_allocate_to_pool"),
    ("set_end_allocate_to_pool_fn", "tensormem_end_allocate_to_pool"),
    ("set_release_pool", "tensormem_release_pool"),
)


def find_library():
    """The path of libtensormem_torch.so: $TENSORMEM_TORCH_LIB, beside this file, or a cargo build."""
    env = os.environ.get("TENSORMEM_TORCH_LIB")
    if env:
        if not os.path.isfile(env):
            raise FileNotFoundError(f"TENSORMEM_TORCH_LIB={env} is not a file")
        return os.path.abspath(env)
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = [os.path.join(here, LIB_NAME)]
    root = os.path.normpath(os.path.join(here, "..", "..", ".."))
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(root, "target"))
    candidates += [os.path.join(target, profile, LIB_NAME) for profile in ("release", "debug")]
    for path in candidates:
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"{LIB_NAME} not found (looked at {', '.join(candidates)}): build it with "
        "`cargo build --release -p tensormem-torch` or set TENSORMEM_TORCH_LIB")


class Plugin:
    """The loaded library: statistics, snapshots and errors through ctypes, and the allocator."""

    def __init__(self, path=None):
        self.path = path or find_library()
        # PyTorch opens the same path again; the loader hands back this same library (one allocator).
        self.lib = ctypes.CDLL(self.path)
        lib = self.lib
        lib.tensormem_memory_stats_json.restype = ctypes.c_void_p
        lib.tensormem_memory_stats_json.argtypes = [ctypes.c_int]
        lib.tensormem_string_free.restype = None
        lib.tensormem_string_free.argtypes = [ctypes.c_void_p]
        lib.tensormem_last_error.restype = ctypes.c_char_p
        lib.tensormem_last_error.argtypes = []
        lib.tensormem_reset_peak_stats.restype = ctypes.c_int
        lib.tensormem_reset_peak_stats.argtypes = [ctypes.c_int]
        lib.tensormem_dump_snapshot.restype = ctypes.c_int
        lib.tensormem_dump_snapshot.argtypes = [ctypes.c_char_p]
        lib.tensormem_record_history.restype = ctypes.c_int
        lib.tensormem_record_history.argtypes = [ctypes.c_int, ctypes.c_size_t]
        self._allocator = None
        self.hooks = []  # the setters that were wired
        self.missing_hooks = []  # the setters this PyTorch does not have

    def last_error(self):
        """The last error a call of the library met on this thread, or None."""
        err = self.lib.tensormem_last_error()
        return err.decode("utf-8", "replace") if err else None

    def _check(self, rc, what):
        if rc != 0:
            raise RuntimeError(f"tensormem: {what} failed: {self.last_error()}")

    def stats(self, device=None):
        """tensormem's torch.cuda.memory_stats(device): a dict under PyTorch's flat keys."""
        if device is None:
            import torch
            device = torch.cuda.current_device()
        raw = self.lib.tensormem_memory_stats_json(int(device))
        if not raw:
            raise RuntimeError(f"tensormem: memory_stats({device}) failed: {self.last_error()}")
        try:
            return json.loads(ctypes.string_at(raw).decode("utf-8"))
        finally:
            self.lib.tensormem_string_free(raw)

    def reset_peak_stats(self, device=None):
        """torch.cuda.reset_peak_memory_stats(device) for tensormem."""
        if device is None:
            import torch
            device = torch.cuda.current_device()
        self._check(self.lib.tensormem_reset_peak_stats(int(device)), "reset_peak_stats")

    def record_history(self, enabled=True, max_entries=100_000):
        """torch.cuda.memory._record_memory_history for tensormem (every device)."""
        self._check(self.lib.tensormem_record_history(1 if enabled else 0, max_entries), "record_history")

    def dump_snapshot(self, path):
        """torch.cuda.memory._dump_snapshot for tensormem: a pickle _memory_viz opens."""
        self._check(self.lib.tensormem_dump_snapshot(os.fsencode(path)), "dump_snapshot")

    def allocator(self):
        """The torch.cuda.memory.CUDAPluggableAllocator on tensormem, with every hook PyTorch accepts."""
        if self._allocator is not None:
            return self._allocator
        import torch
        allocator = torch.cuda.memory.CUDAPluggableAllocator(self.path, "tensormem_alloc", "tensormem_free")
        native = allocator.allocator()
        for setter, function in HOOKS:
            set_hook = getattr(native, setter, None)
            if set_hook is None:
                self.missing_hooks.append(setter)
                continue
            set_hook(ctypes.cast(getattr(self.lib, function), ctypes.c_void_p).value)
            self.hooks.append(setter)
        self._allocator = allocator
        return allocator

    def install(self):
        """Makes tensormem PyTorch's CUDA allocator (before the first CUDA allocation)."""
        import torch
        torch.cuda.memory.change_current_allocator(self.allocator())
        missing_graph = {"set_begin_allocate_to_pool", "set_end_allocate_to_pool_fn"} & set(self.missing_hooks)
        if missing_graph:
            import warnings
            warnings.warn(f"this PyTorch has no {sorted(missing_graph)}: do not capture CUDA graphs "
                          "on tensormem's allocator", RuntimeWarning)
        return self

    def mem_pool(self):
        """A torch.cuda.MemPool whose segments come from tensormem (PyTorch's allocator caches them)."""
        import torch
        return torch.cuda.MemPool(self.allocator().allocator())


def install(path=None):
    """Loads the library and makes tensormem PyTorch's CUDA allocator; returns the Plugin."""
    return Plugin(path).install()


def mem_pool(path=None):
    """A torch.cuda.MemPool on tensormem, PyTorch's allocator staying current; returns (Plugin, pool)."""
    plugin = Plugin(path)
    return plugin, plugin.mem_pool()

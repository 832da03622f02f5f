"""PyTorch on tensormem's CUDA caching allocator.

``install()`` makes tensormem PyTorch's CUDA allocator, before the first CUDA allocation::

    import tensormem_torch
    tensormem_torch.install()
    ...                                   # run the model as usual
    torch.cuda.memory_stats()             # tensormem's statistics, under PyTorch's keys

By default tensormem replaces PyTorch's caching allocator as a whole: a small C++ layer
(``csrc/tensormem_allocator.cpp``, shipped with this package beside ``csrc/tensormem_abi.h``, the
library's C interface) implements PyTorch's ``c10::cuda::CUDACachingAllocator::CUDAAllocator`` interface
on ``libtensormem_torch.so``. It is compiled against the installed PyTorch the first time
(``torch.utils.cpp_extension``, a minute or so) and cached under ``$TENSORMEM_TORCH_CACHE`` (default
``~/.cache/tensormem_torch``), keyed by the PyTorch version, the C++ source and header and the library,
so that upgrading either rebuilds it. Everything PyTorch's own allocator
answers then works on tensormem: ``torch.cuda.memory_stats()``, ``memory._snapshot()``,
``_dump_snapshot()``, CUDA graphs and ``torch.compile(mode="reduce-overhead")``, ``torch.cuda.MemPool``,
``torch.OutOfMemoryError``, ``torch.multiprocessing`` sharing of CUDA tensors.

Where the C++ layer cannot be compiled (no compiler, no CUDA headers), ``install(mode="auto")`` falls back
to PyTorch's ``CUDAPluggableAllocator`` with a warning; ``mode="pluggable"`` asks for it. Its limits are
PyTorch's: no ``memory_stats()`` (use ``plugin.stats()``), no ``MemPool`` or graph trees, and an
out-of-memory error is fatal to the process.

The library is found at ``$TENSORMEM_TORCH_LIB``, else inside this package, else beside it, else in the
workspace's ``target/release`` or ``target/debug``.

``tensormem_torch.weights`` moves a model's weights from one process into another's own tensors, version after
version (a publisher in the trainer, a subscriber in the engine); it loads the library through ctypes and works
whether or not tensormem is PyTorch's allocator. ``tensormem_torch.nccl_weights`` moves them from one rank into the
other ranks' own tensors through NCCL (an RL trainer into inference engines on other GPUs or machines).

What ``install()`` needs and does not find (PyTorch, a CUDA build of it and a visible GPU; for the C++ layer
a C++ compiler, ninja and CUDA's headers) is one ``InstallError`` whose one-line message names what is
missing and what to do (``pip install crates/torch-plugin`` installs PyTorch from PyPI where it is missing).
"""
import ctypes
import hashlib
import json
import os
import shutil
import warnings

from . import nccl_weights, weights  # import no torch until used
from ._paths import HERE, LIB_NAME, find_library
from .regions import is_asleep, region, regions, sleep, sleep_regions, wake, wake_regions
from .sleep import reserve_backup_memory

__all__ = ["Plugin", "InstallError", "install", "mem_pool", "find_library", "find_source", "build_extension",
           "HOOKS", "sleep", "wake", "is_asleep", "region", "regions", "sleep_regions", "wake_regions",
           "reserve_backup_memory",
           "weights", "nccl_weights"]

SOURCE_NAME = "tensormem_allocator.cpp"
HEADER_NAME = "tensormem_abi.h"  # the library's C interface, which the source includes

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


class InstallError(RuntimeError):
    """What ``install()`` needs and did not find, and what to do, in one line."""


def _require_cuda_torch():
    """PyTorch, built with CUDA, seeing a GPU: returns the module, else raises InstallError.

    ``torch.cuda.is_available()`` counts devices without initialising PyTorch's allocator, so the
    allocator can still be replaced after it.
    """
    try:
        import torch
    except ImportError as e:
        raise InstallError(f"tensormem_torch.install() needs PyTorch, which does not import ({e}): install a "
                           "CUDA build of it (`pip install torch`, or the command pytorch.org gives for your "
                           "CUDA version)") from None
    if torch.version.cuda is None:
        raise InstallError(f"tensormem_torch.install() needs a CUDA build of PyTorch; torch {torch.__version__} "
                           "has no CUDA (a CPU-only or ROCm build): install a CUDA build (`pip install torch` "
                           "on Linux x86-64, or the command pytorch.org gives for your CUDA version)")
    if not torch.cuda.is_available():
        raise InstallError("tensormem_torch.install() needs a CUDA GPU and torch.cuda.is_available() is False: "
                           "run on a machine with an NVIDIA GPU and driver (check `nvidia-smi` and "
                           "CUDA_VISIBLE_DEVICES)")
    return torch


def _require_build_tools():
    """What compiling the C++ layer needs (torch.utils.cpp_extension's tools): raises InstallError if missing."""
    from torch.utils import cpp_extension
    fallback = "or call install(mode=\"pluggable\") (PyTorch's limited CUDAPluggableAllocator, no compiler needed)"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise InstallError(f"compiling tensormem's C++ allocator layer needs a C++ compiler and `{compiler}` "
                           f"is not on PATH: install one (e.g. `apt-get install g++`) or set CXX, {fallback}")
    if not cpp_extension.is_ninja_available():
        raise InstallError("compiling tensormem's C++ allocator layer needs ninja, which is not on PATH: "
                           f"`pip install ninja`, {fallback}")


def _one_line(error):
    """An error's first line, with the first later line that names an error (a compiler's diagnostic)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    detail = next((line for line in lines[1:] if "error" in line.lower()), None)
    return f"{lines[0]} {detail}" if detail else lines[0]


def find_source():
    """The path of the C++ layer's source, with the library's header beside it: in this package (wheel) or
    in the crate (checkout)."""
    crate = os.path.normpath(os.path.join(HERE, "..", ".."))
    folders = [os.path.join(HERE, "csrc"), os.path.join(crate, "csrc")]
    for folder in folders:
        if all(os.path.isfile(os.path.join(folder, name)) for name in (SOURCE_NAME, HEADER_NAME)):
            return os.path.abspath(os.path.join(folder, SOURCE_NAME))
    raise FileNotFoundError(f"{SOURCE_NAME} and {HEADER_NAME} not found together (looked in "
                            f"{', '.join(folders)}): reinstall the package")


def _cache_key(lib, source):
    import torch
    digest = hashlib.sha256()
    digest.update(torch.__version__.encode())
    digest.update(str(torch.version.cuda).encode())
    for path in (source, os.path.join(os.path.dirname(source), HEADER_NAME)):
        with open(path, "rb") as f:
            digest.update(f.read())
    st = os.stat(lib)
    digest.update(f"{os.path.realpath(lib)}:{st.st_size}:{st.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def build_extension(lib=None, verbose=False):
    """Compiles the C++ layer against the installed PyTorch (once; cached) and returns its path."""
    from torch.utils import cpp_extension
    lib = lib or find_library()
    source = find_source()
    key = _cache_key(lib, source)
    cache = os.environ.get("TENSORMEM_TORCH_CACHE",
                           os.path.join(os.path.expanduser("~"), ".cache", "tensormem_torch"))
    build_dir = os.path.join(cache, key)
    os.makedirs(build_dir, exist_ok=True)
    name = f"tensormem_torch_cpp_{key}"
    out = os.path.join(build_dir, name + ".so")
    if os.path.isfile(out):
        return out
    _require_build_tools()
    libdir = os.path.dirname(os.path.realpath(lib))
    try:
        cpp_extension.load(
            name=name,
            sources=[source],
            extra_include_paths=[os.path.dirname(source)],  # tensormem_abi.h
            build_directory=build_dir,
            extra_cflags=["-O2"],
            extra_ldflags=[f"-L{libdir}", "-ltensormem_torch", f"-Wl,-rpath,{libdir}"],
            with_cuda=True,
            is_python_module=False,
            verbose=verbose,
        )
    except Exception as e:  # noqa: BLE001 - one line, and where to see the rest
        raise InstallError(f"compiling tensormem's C++ allocator layer failed ({_one_line(e)}): it needs "
                           "CUDA's headers (a CUDA toolkit, CUDA_HOME) beside the compiler, and "
                           "install(verbose=True) shows the compiler's output; or call "
                           "install(mode=\"pluggable\")") from None
    if not os.path.isfile(out):
        raise RuntimeError(f"tensormem: building the C++ layer left no {out}")
    return out


class Plugin:
    """The loaded library: statistics, snapshots and errors through ctypes, and the allocator."""

    def __init__(self, path=None):
        self.path = path or find_library()
        # The C++ layer links the same library (by its soname): one library, one allocator.
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
        self.mode = None  # "native" or "pluggable" once installed
        self.extension = None  # the C++ layer's path, in native mode
        self.hooks = []  # the setters that were wired (pluggable mode)
        self.missing_hooks = []  # the setters this PyTorch does not have (pluggable mode)

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

    def install_native(self, verbose=False):
        """Makes tensormem PyTorch's whole CUDA allocator through the C++ layer (built if needed)."""
        self.extension = build_extension(self.path, verbose=verbose)
        ext = ctypes.CDLL(self.extension)
        ext.tensormem_torch_install.restype = ctypes.c_int
        ext.tensormem_torch_install.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        error = ctypes.create_string_buffer(4096)
        if ext.tensormem_torch_install(error, len(error)) != 0:
            raise RuntimeError(f"tensormem: installing the allocator failed: {error.value.decode(errors='replace')}")
        self._route_settings()
        self.mode = "native"
        return self

    def _route_settings(self):
        """Every way PyTorch offers to change allocator settings at run time reaches PyTorch's own
        settings only: route each here too, after PyTorch's (see _route_settings_of)."""
        import torch
        lib = self.lib
        lib.tensormem_set_allocator_settings.restype = ctypes.c_int
        lib.tensormem_set_allocator_settings.argtypes = [ctypes.c_char_p]

        def apply(env):
            if lib.tensormem_set_allocator_settings(env.encode()) != 0:
                raise RuntimeError(f"tensormem: allocator settings {env!r}: {self.last_error()}")

        _route_settings_of(torch, apply)

    def install_pluggable(self):
        """Makes tensormem PyTorch's allocator through CUDAPluggableAllocator (the limited fallback)."""
        import torch
        torch.cuda.memory.change_current_allocator(self.allocator())
        self._route_settings()
        missing_graph = {"set_begin_allocate_to_pool", "set_end_allocate_to_pool_fn"} & set(self.missing_hooks)
        if missing_graph:
            warnings.warn(f"this PyTorch has no {sorted(missing_graph)}: do not capture CUDA graphs "
                          "on tensormem's allocator", RuntimeWarning)
        self.mode = "pluggable"
        return self

    def install(self, mode="auto", verbose=False):
        """Makes tensormem PyTorch's CUDA allocator (before the first CUDA allocation).

        mode: "native" (the whole CUDAAllocator; fails if the C++ layer cannot be built), "pluggable"
        (CUDAPluggableAllocator), or "auto" (native, else pluggable with a warning).

        Raises InstallError, one line naming what is missing and what to do, where PyTorch, a CUDA build
        of it or a GPU is missing, or (mode "native") where the C++ layer cannot be compiled.
        """
        mode = os.environ.get("TENSORMEM_TORCH_MODE", mode)
        if mode not in ("native", "auto", "pluggable"):
            raise ValueError(f"mode must be 'auto', 'native' or 'pluggable', not {mode!r}")
        _require_cuda_torch()
        if mode == "pluggable":
            return self.install_pluggable()
        try:
            return self.install_native(verbose=verbose)
        except Exception as e:  # noqa: BLE001 - the fallback says why
            if mode == "native":
                raise
            reason = _one_line(e)
        # Outside the handler: a failure of the fallback is its own error, not one chained to the first.
        warnings.warn(f"tensormem: the C++ allocator layer could not be used ({reason}); falling back to "
                      "CUDAPluggableAllocator, without memory_stats(), MemPool, graph trees or "
                      "recoverable out-of-memory errors", RuntimeWarning)
        return self.install_pluggable()

    def mem_pool(self):
        """A torch.cuda.MemPool whose segments come from tensormem (PyTorch's allocator caches them)."""
        import torch
        return torch.cuda.MemPool(self.allocator().allocator())


# The functions of torch._C that change allocator settings at run time: PyTorch 2.9 and later
# (torch._C._accelerator_setAllocatorSettings, which torch.cuda.memory._set_allocator_settings calls by
# name, and which PyTorch 2.10 and later tell its users to call instead), and the earlier name.
SETTINGS_BINDINGS = ("_accelerator_setAllocatorSettings", "_cuda_cudaCachingAllocator_set_allocator_settings")
# The Python functions that change them, each calling one of the above: (module, name).
SETTINGS_HELPERS = (("torch.cuda.memory", "_set_allocator_settings"),)


def _route_settings_of(torch, apply):
    """Makes each of PyTorch's ways to change allocator settings (SETTINGS_BINDINGS, SETTINGS_HELPERS) call
    `apply(env)` after PyTorch's own function, which still runs first and raises its own errors; a string
    PyTorch took and `apply` refuses raises apply's error. A call goes to `apply` once, whichever way in
    (a helper calling a binding). Routing twice changes nothing."""
    import functools
    import importlib
    import threading

    inside = threading.local()  # set while a routed function runs: the inner calls leave `apply` to it

    def routed(original):
        if getattr(original, "_tensormem_routed", False):
            return original

        @functools.wraps(original)
        def call(env, *args, **kwargs):
            if getattr(inside, "active", False):
                return original(env, *args, **kwargs)
            inside.active = True
            try:
                result = original(env, *args, **kwargs)
            finally:
                inside.active = False
            apply(env)
            return result

        call._tensormem_routed = True
        return call

    for name in SETTINGS_BINDINGS:
        if hasattr(torch._C, name):
            setattr(torch._C, name, routed(getattr(torch._C, name)))
    for module_name, name in SETTINGS_HELPERS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if hasattr(module, name):
            setattr(module, name, routed(getattr(module, name)))


def install(path=None, mode="auto", verbose=False):
    """Loads the library and makes tensormem PyTorch's CUDA allocator; returns the Plugin."""
    return Plugin(path).install(mode=mode, verbose=verbose)


def mem_pool(path=None):
    """A torch.cuda.MemPool on tensormem, PyTorch's allocator staying current; returns (Plugin, pool)."""
    plugin = Plugin(path)
    return plugin, plugin.mem_pool()

"""Where the library is and how it is loaded: one place for the package's modules (``find_library``,
``load_library``, ``last_error``), below all of them."""
import ctypes
import os

LIB_NAME = "libtensormem_torch.so"
HERE = os.path.dirname(os.path.abspath(__file__))


def _first_file(candidates, what, hint):
    for path in candidates:
        if os.path.isfile(path):
            return os.path.abspath(path)
    raise FileNotFoundError(f"{what} not found (looked at {', '.join(candidates)}): {hint}")


def find_library():
    """The path of libtensormem_torch.so: $TENSORMEM_TORCH_LIB, in or beside this package, or a cargo build."""
    env = os.environ.get("TENSORMEM_TORCH_LIB")
    if env:
        if not os.path.isfile(env):
            raise FileNotFoundError(f"TENSORMEM_TORCH_LIB={env} is not a file")
        return os.path.abspath(env)
    candidates = [os.path.join(HERE, LIB_NAME), os.path.join(HERE, "..", LIB_NAME)]
    crate = os.path.normpath(os.path.join(HERE, "..", ".."))
    root = os.path.normpath(os.path.join(crate, "..", ".."))
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(root, "target"))
    candidates += [os.path.join(target, profile, LIB_NAME) for profile in ("release", "debug")]
    return _first_file(candidates, LIB_NAME,
                       "build it with `cargo build --release -p tensormem-torch`, install the wheel "
                       "(`pip install crates/torch-plugin`) or set TENSORMEM_TORCH_LIB")


def load_library(signatures):
    """libtensormem_torch.so through ctypes (the same library ``tensormem_torch.install()`` loads, if it
    was), with each function of ``signatures`` (``{name: argtypes}``) returning an ``int`` status, and
    ``tensormem_last_error`` for the message of the last failure."""
    lib = ctypes.CDLL(find_library())
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = argtypes
    lib.tensormem_last_error.restype = ctypes.c_char_p
    lib.tensormem_last_error.argtypes = []
    return lib


def last_error(lib):
    """The message of ``lib``'s last failure on this thread."""
    err = lib.tensormem_last_error()
    return err.decode("utf-8", "replace") if err else "unknown error"

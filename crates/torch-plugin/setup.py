"""Builds the tensormem-torch wheel: the Python package `tensormem_torch`, the Rust library
`libtensormem_torch.so` (built with `cargo build --release -p tensormem-torch`, or taken from
$TENSORMEM_TORCH_LIB) and the C++ layer's source with the library's header (csrc/), which the package
compiles against the installed PyTorch on first use.

    pip install crates/torch-plugin                   # from the repository root; needs cargo
    pip wheel --no-deps crates/torch-plugin -w dist/  # a wheel to install where there is no Rust

The package depends on torch and ninja (pyproject.toml); `--no-deps` keeps pip from fetching them.
"""
import os
import shutil
import subprocess
import sysconfig

from setuptools import setup
from setuptools.command.build_py import build_py

try:
    from wheel.bdist_wheel import bdist_wheel
except ImportError:  # pragma: no cover - wheel is a build requirement
    bdist_wheel = None

HERE = os.path.dirname(os.path.abspath(__file__))
LIB = "libtensormem_torch.so"


def rust_library():
    """The library to ship: $TENSORMEM_TORCH_LIB, else a fresh release build of the crate."""
    env = os.environ.get("TENSORMEM_TORCH_LIB")
    if env:
        return env
    subprocess.check_call(["cargo", "build", "--release", "-p", "tensormem-torch"], cwd=HERE)
    target = os.environ.get("CARGO_TARGET_DIR") or subprocess.check_output(
        ["cargo", "metadata", "--format-version", "1", "--no-deps"], cwd=HERE, text=True
    ).split('"target_directory":"', 1)[1].split('"', 1)[0]
    return os.path.join(target, "release", LIB)


class BuildWithLibrary(build_py):
    """Copies the Rust library and the C++ source and header into the package."""

    def run(self):
        super().run()
        package = os.path.join(self.build_lib, "tensormem_torch")
        os.makedirs(os.path.join(package, "csrc"), exist_ok=True)
        shutil.copy2(rust_library(), os.path.join(package, LIB))
        # The C++ layer's source and the header of the library's C interface it includes.
        for name in ("tensormem_allocator.cpp", "tensormem_abi.h"):
            shutil.copy2(os.path.join(HERE, "csrc", name), os.path.join(package, "csrc"))


commands = {"build_py": BuildWithLibrary}
if bdist_wheel is not None:

    class PlatformWheel(bdist_wheel):
        """The wheel holds a native library: tag it for this platform, for any Python 3."""

        def finalize_options(self):
            super().finalize_options()
            self.root_is_pure = False

        def get_tag(self):
            return "py3", "none", sysconfig.get_platform().replace("-", "_").replace(".", "_")

    commands["bdist_wheel"] = PlatformWheel

setup(cmdclass=commands)

"""Build-on-first-use loader for the small C++ kernels in kernels/csrc/.

The sources use a plain C ABI and no torch headers, so one `g++` call (about a second) builds
them on any machine with a C++17 compiler; no ninja, no CUDA toolkit. The shared object is cached
under ``$DAWNBENCH_KERNEL_CACHE`` (default ``~/.cache/dawnbench/kernels``), keyed by a hash of the
source, the flags and the compiler, and written atomically so concurrent ranks never load a
half-written file. If the build fails, `load` warns once and returns None and the caller uses its
torch path. `build_all` builds everything ahead of time (for `make setup`):
``python -c "from kernels._native import build_all; build_all()"``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
# No -ffast-math: the float64 sum that sets mean(|x|) must stay exact IEEE arithmetic, as torch's.
# No -march=native: the cached object must run on every machine sharing the cache directory.
FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-pthread"]
# lars_cpu runs its threads with OpenMP. Its libgomp.so.1 resolves to the one torch has already
# loaded (same soname), so the kernel runs on torch's own OpenMP threads, which after the previous
# torch op are still spinning on the cores, where std::threads would share a core with one of
# them and slow the step down. Where torch ships another OpenMP
# runtime, the system libgomp loads beside it and the kernel still works, on threads of its own.
EXTRA_FLAGS = {"lars_cpu": ["-fopenmp"]}


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "dawnbench" / "kernels"
    return Path(os.environ.get("DAWNBENCH_KERNEL_CACHE", default))


def _compiler_id(cxx: str) -> str:
    return subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout


def build(name: str) -> Path:
    """Compiles kernels/csrc/<name>.cpp unless a cached build exists; returns the .so path.

    Raises OSError or subprocess.CalledProcessError (with the compiler output) on failure.
    """
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise OSError(f"C++ compiler {cxx!r} not found (set CXX or install g++)")
    source = CSRC / f"{name}.cpp"
    flags = FLAGS + EXTRA_FLAGS.get(name, [])
    key = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()
                         + _compiler_id(cxx).encode())
    target = cache_dir() / f"{name}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([cxx, *flags, str(source), "-o", tmp], capture_output=True, text=True,
                       check=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """The built library, or None (with one warning) when it cannot be built or loaded."""
    try:
        return ctypes.CDLL(str(build(name)))
    except (OSError, subprocess.CalledProcessError) as err:
        detail = getattr(err, "stderr", None) or err
        warnings.warn(f"kernels: could not build {name} ({detail}); using the slower torch path",
                      RuntimeWarning, stacklevel=2)
        return None


def build_all() -> list[Path]:
    """Builds (or finds cached) every kernels/csrc/*.cpp; raises on the first failure."""
    return [build(path.stem) for path in sorted(CSRC.glob("*.cpp"))]

"""Compile the packed engine's kernels (``kernels.cpp``) on first use, once per machine and torch version.

torch's C++ extension loader builds with the compiler already on the machine and caches the library under
``TORCH_EXTENSIONS_DIR`` (``~/.cache/torch_extensions``), so only the first process on a machine waits for it
(about a minute on 2 cores). The flags ask for AVX2 with FMA and F16C, which every x86 CPU this project runs on
has; the AVX-512 kernels inside are compiled for their own target and chosen at run time
(:func:`kernels_name`), so one build runs on AVX2-only and AVX-512 CPUs alike.
"""

from __future__ import annotations

import os
import platform
import threading
import warnings
from functools import cache
from pathlib import Path
from types import ModuleType

from backends.errors import ModelLoadError

SOURCE = Path(__file__).with_name("kernels.cpp")
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-std=c++17"]
"""No fp contraction: every fused multiply-add is written out, so both instruction sets round alike. The kernels run on
threads of their own (``compute_pool.h``); OpenMP only for ``serial_torch_on_this_thread``, which sets the calling
thread's OpenMP thread count in the libgomp torch has already loaded (same soname)."""
_BUILD_LOCK = threading.Lock()


def supported() -> bool:
    """Whether this machine can run the kernels: x86-64 with AVX2, FMA and F16C."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return all(flag in flags for flag in ("avx2", "fma", "f16c"))


def kernels_name() -> str:
    """Which of the engine's builds this CPU runs, as ``PackedModel.kernels`` says it: ``avx512`` where it has
    AVX-512 with BW, VL and VNNI, else ``avx2``. ``DSPARK_KERNELS=avx2`` forces the AVX2 build, as it does for the
    engine; ``avx512`` cannot force what the CPU lacks. Read from the CPU's flags, so a cost curve's key is known
    before anything is built; a test holds it to the engine's own choice."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "avx2"
    runs_avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags
    return "avx512" if runs_avx512 and os.environ.get("DSPARK_KERNELS") != "avx2" else "avx2"


@cache
def _compiled() -> ModuleType:
    from torch.utils.cpp_extension import load

    return load(
        name="dspark_packed",
        sources=[str(SOURCE)],
        extra_cflags=FLAGS,
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[str(SOURCE.parent)],
        verbose=False,
    )


def kernels() -> ModuleType:
    """The compiled module (built now if this machine has no build yet)."""
    if not supported():
        raise ModelLoadError("the packed engine needs an x86-64 CPU with AVX2, FMA and F16C", param="dtype")
    with _BUILD_LOCK:
        try:
            return _compiled()
        except (OSError, RuntimeError, ImportError) as exc:
            raise ModelLoadError(f"cannot build the packed engine's kernels: {exc}", param="dtype") from exc


@cache
def usable() -> bool:
    """Whether the kernels run here: the CPU has the instructions and they build (a machine without a C++
    compiler cannot). Where they do not, ``dtype: auto`` serves transformers instead, and says why once."""
    try:
        kernels()
    except ModelLoadError as exc:
        warnings.warn(f"{exc}; serving the float model with transformers instead", stacklevel=2)
        return False
    return True

"""Which CPU this is, and what a model folder runs in on a device, named without importing torch.

The router keys each pool's cost curve by machine and precision before any model loads (and ``dspark-router
route`` decides without loading one), so these answers come from ``/proc/cpuinfo`` and the folder's files alone;
:mod:`backends.loading` turns the names into torch dtypes when it loads.
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from functools import cache
from pathlib import Path

QUANTIZED_PRECISION = "gguf"
"""How a machine key and a benchmark name what the packed engine serves (the GGUF's own blocks)."""
PACKED_FILE = "gguf_blocks.safetensors"
"""The GGUF's blocks beside a converted folder's float32 reference (:mod:`backends.packed.weights`)."""
DTYPE_NAMES = ("float32", "bfloat16", "float16")
PRECISIONS = ("auto", QUANTIZED_PRECISION, *DTYPE_NAMES)
"""What a pool's ``dtype`` may say: ``gguf`` serves the GGUF's own blocks on the packed engine."""
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
BF16_MIN_WEIGHT_BYTES = 100_000_000
"""``auto`` runs a model in bfloat16 on a CPU from this size of float32 weights: there a forward is bound by
reading the weights, and a verifying pass of 8 tokens costs 1.2 single steps in bfloat16 against 2.2 in float32
(SmolLM2-135M, 2 threads, Sapphire Rapids). Below it a forward is interpreter overhead that bfloat16 cannot cut,
and float32 stays the exact reference."""


@cache
def _cpu_fields() -> dict[str, str]:
    """The first processor's ``key: value`` lines of ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    first = text.split("\n\n", 1)[0]
    return {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in first.splitlines())}


def cpu_name() -> str:
    """The CPU's model name: machines differ, so a stored cost curve and every benchmark figure say which one
    measured them (``platform.processor()`` says only ``x86_64`` on Linux)."""
    return _cpu_fields().get("model name") or platform.processor() or platform.machine()


def cpu_generation() -> str | None:
    """The CPU's family and model numbers (``family 23 model 1``), which tell apart what a cloud's model name does
    not: its "AMD EPYC" has been a Zen 1 with AVX2 alone and a Zen 4 with AVX-512, at four times the speed apart.
    None where ``/proc/cpuinfo`` does not say."""
    fields = _cpu_fields()
    if "cpu family" not in fields or "model" not in fields:
        return None
    return f"family {fields['cpu family']} model {fields['model']}"


def cpu_chip() -> str:
    """The CPU as a cost curve's key and a benchmark's figures name it: its model name and, where known, its
    family and model numbers, so one "AMD EPYC" (a Zen 1) never lends its curve to another (a Zen 3)."""
    generation = cpu_generation()
    return f"{cpu_name()} ({generation})" if generation else cpu_name()


@cache
def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AMX or AVX-512 BF16): elsewhere bfloat16 is emulated and
    slower than float32. Read once: training asks at every step."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return any(flag in flags for flag in BF16_CPU_FLAGS)


def has_packed(folder: Path) -> bool:
    """Whether a folder was converted from a GGUF whose blocks the packed engine reads."""
    return (folder / PACKED_FILE).is_file()


def dtype_name(dtype: str, device_type: str, path: Path | None = None) -> str:
    """``auto``: bfloat16 on GPUs; on a CPU bfloat16 where it has the instructions and the model is big enough for
    it to pay (:data:`BF16_MIN_WEIGHT_BYTES`), float32 otherwise. Raises ValueError for a name it does not know."""
    if dtype == "auto":
        if device_type == "cuda":
            return "bfloat16"
        weights = sum(f.stat().st_size for f in path.glob("*.safetensors")) if path is not None else 0
        return "bfloat16" if cpu_has_bf16() and weights >= BF16_MIN_WEIGHT_BYTES else "float32"
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {', '.join(PRECISIONS)}; got {dtype!r}")
    return dtype


def precision_name(dtype: str, device_type: str, path: Path | None, kernels_run: Callable[[], bool]) -> str:
    """``gguf`` (the packed engine on the folder's GGUF blocks) where ``dtype`` is ``auto`` or ``gguf``, the device a
    CPU whose kernels run (``kernels_run``: the build itself when loading, the CPU's instructions when only naming a
    curve) and the folder was converted from a GGUF; else :func:`dtype_name`. Raises ValueError where ``gguf`` is
    asked for and cannot serve.

    The packed engine is the default because it reads 4-bit blocks, not float copies of them, and gives every token
    the same logits whatever shares its forward (greedy speculative decoding is then exactly plain decoding)."""
    packable = device_type == "cpu" and path is not None and has_packed(path) and kernels_run()
    if dtype == QUANTIZED_PRECISION and not packable:
        raise ValueError(
            "dtype gguf needs a folder converted from a GGUF with Q4_1, Q8_0 or float blocks (dspark-router convert) "
            "and an x86-64 CPU with AVX2"
        )
    if dtype in ("auto", QUANTIZED_PRECISION) and packable:
        return QUANTIZED_PRECISION
    return dtype_name(dtype, device_type, path)

"""Stored cost curves (``dspark_sps.json``): the key each machine's curve is kept under, and the curve a machine
reads when its own was never measured. Torch-free to import: the router reads curves before any model loads.

A key names the device and chip, the precision a forward runs in (the packed engine's with its kernels' build:
``gguf-avx512``, ``gguf-avx2``) and the threads a forward runs on: ``cpu:AMD EPYC (family 25 model
17)|gguf-avx512|threads=2``. A CPU is named with its family and model numbers: a cloud's "AMD EPYC" has been a Zen
1, a Zen 3 and a Zen 4, and the same AVX2 build verifies four tokens at 2.1 steps' cost on the Zen 1 and 1.7 on the
Zen 3. Keys stored before the numbers were added name the model alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from backends.packed.build import kernels_name
from backends.packed.build import supported as kernels_supported
from backends.packed.pool import default_threads
from backends.precision import QUANTIZED_PRECISION, cpu_chip, precision_name
from backends.scheduling import SpsCurve, scaled_speedup


def machine_key(device: Any, precision: Any, threads: int | None = None) -> str:
    """The key of a curve measured on ``device`` (a torch device) in ``precision`` (``gguf`` or a torch dtype) on
    ``threads`` (None: the default for that precision, the packed engine's or torch's)."""
    import torch

    chip = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_chip()
    if precision == QUANTIZED_PRECISION:
        return _key(device.type, chip, f"{precision}-{kernels_name()}", threads or default_threads())
    return _key(device.type, chip, str(precision), threads or torch.get_num_threads())


def pool_machine_key(model: Path, device: str, dtype: str, threads: int | None) -> str:
    """The key of the curve a pool's workers would measure here, before anything loads: on a machine without a
    GPU, and a folder the packed engine serves, without importing torch (``dspark-router route`` decides without
    loading it); else as :func:`machine_key` of what ``load_model`` would resolve."""
    if device in ("auto", "cpu") and not _gpu_driver():
        name = precision_name(dtype, "cpu", model, kernels_supported)
        if name == QUANTIZED_PRECISION:
            return _key("cpu", cpu_chip(), f"{name}-{kernels_name()}", threads or default_threads())
    from backends.loading import resolve_device, resolve_precision

    resolved = resolve_device(device)
    return machine_key(resolved, resolve_precision(dtype, resolved, model), threads)


def _gpu_driver() -> bool:
    """Whether an NVIDIA driver is loaded: where none is, ``auto`` is the CPU without asking torch."""
    return Path("/proc/driver/nvidia").exists()


def _key(device_type: str, chip: str, precision: str, threads: int) -> str:
    return f"{device_type}:{chip}|{precision}|threads={threads}"


def stored_curves(file: Path) -> dict[str, dict[str, float]]:
    """Every machine's curve in a ``dspark_sps.json`` (none when there is no file)."""
    return json.loads(file.read_text()) if file.is_file() else {}


def machine_parts(key: str) -> tuple[str, str, str, str]:
    """(device type, chip name, precision, threads) of a :func:`machine_key`; empty strings where a key written
    some other way lacks a part."""
    device_chip, _, rest = key.partition("|")
    device, _, chip = device_chip.partition(":")
    precision, _, threads = rest.partition("|")
    return device, chip, precision, threads


def closest_curve(curves: dict[str, dict[str, float]], key: str | None) -> dict[str, float] | None:
    """The curve stored under ``key``; else one of a machine of the same device type, precision and threads (the
    same costs but for the chip's name: another model of Xeon runs bfloat16 on AMX alike); else one of the same
    precision; else the last stored; None where nothing is."""
    if key in curves:
        return curves[key]
    device, _, precision, threads = machine_parts(key or "")
    parts = {stored: machine_parts(stored) for stored in curves}
    alike = [k for k, (d, _, p, t) in parts.items() if (d, p, t) == (device, precision, threads)]
    same_precision = [k for k, (_, _, p, _) in parts.items() if p == precision]
    chosen = [*alike, *same_precision, *list(curves)[-1:]]
    return curves[chosen[0]] if chosen else None


def carry_factor(curves: dict[str, dict[str, float]], measured_on: str, here: str) -> float:
    """What a solo speedup measured on machine ``measured_on`` is multiplied by on machine ``here``, from their
    stored curves: :func:`~backends.scheduling.scaled_speedup` at a batch of one, which is linear in it."""
    there_curve, here_curve = (SpsCurve.from_stored(curves[machine]).monotone() for machine in (measured_on, here))
    return scaled_speedup(1.0, there_curve, here_curve)

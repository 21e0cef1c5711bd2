"""The packed engine's threads: how many it runs by default, and the process's pool for a count.

Every parallel loop of a forward (the target's, a drafter's backbone, a drafter's rows of the LM head) runs on a
pool the compiled extension owns (``compute_pool.h``), not on torch's OpenMP threads, so nothing the host process
does with OpenMP, torch, numpy or llama.cpp changes the engine's speed. One pool per thread count, shared by every
model in the process that asks for that count; its idle threads sleep.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path
from typing import Any

from backends.packed.build import kernels


@cache
def default_threads() -> int:
    """The physical cores this process may run on: a decode step is bound by reading the weights, which a second
    hardware thread of a core does not speed up, and a thread more than the cores leaves one of a forward's loops
    waiting for the OS to run it."""
    cores = set()
    for cpu in os.sched_getaffinity(0):
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add((topology / "physical_package_id").read_text().strip() + ":" + (topology / "core_id").read_text())
        except OSError:
            cores.add(str(cpu))
    return max(1, len(cores))


def compute_pool(threads: int | None = None) -> Any:
    """The process's pool of ``threads`` threads (None: :func:`default_threads`), made on first use."""
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be at least 1, not {threads}")
    return kernels().compute_pool(threads or default_threads())


def serial_torch_on_this_thread() -> None:
    """This thread's own torch ops run serially from now on, other threads' as before. For a thread that drives the
    engine: its torch ops are small (a token's logits, a drafter's heads), and an OpenMP team of its own would leave
    a helper thread spinning, after each of them, on a core the pool's workers need (DSpark decoding measured 175
    tokens/s with it against 235 without, Intel Xeon, 2 cores)."""
    kernels().serial_torch_on_this_thread()

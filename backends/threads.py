"""Which thread runs a backend's torch work, and why it matters (torch-free, so the router can import it).

A torch op big enough to run as an OpenMP parallel region (building span heads is one) gives the thread that
runs it an OpenMP team, which lives as long as that thread. Once a process holds more OpenMP threads than
cores, libgomp stops spin-waiting in every team, and each of a decode step's many small parallel regions then
pays a wake-up: half the batch's throughput on two cores, and a forward of a few draft tokens at 2-3x its
cost. So torch work runs on threads that end with it: a backend loads on a thread of its own
(:func:`on_own_thread`: a pool's loader, and ``DSparkBackend.from_pretrained`` whoever calls it), benchmarks
run their own torch calls (transformers' ``generate``) the same way, and a decode engine's thread ends soon
after its batch empties (:data:`backends.engine.IDLE_EXIT_S`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def on_own_thread(work: Callable[[], T], name: str = "backend-load") -> T:
    """``work()`` run on a thread that ends with it, so no OpenMP team it makes outlives it; its result, or its
    exception raised here."""
    outcome: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            outcome.append(work())
        except BaseException as exc:  # raised again in the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return outcome[0]

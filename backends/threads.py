"""Which thread runs transformers' torch work, and why it matters (torch-free, so the router can import it).

The packed engine runs on threads of its own (:mod:`backends.packed.pool`) and nothing here concerns it.
transformers' engine (the float32 reference, or a model the kernels cannot serve) runs on torch's OpenMP threads:
a torch op big enough to run as an OpenMP parallel region (loading a model is one) gives the thread that runs it
an OpenMP team, which lives as long as that thread, and once a process holds more OpenMP threads than cores,
libgomp stops spin-waiting in every team and each of a decode step's many small parallel regions pays a wake-up.
So backends load on a thread that ends with the load (:func:`on_own_thread`: a pool's loader, and
``DSparkBackend.from_pretrained`` whoever calls it): a tiny model's transformers engine decoded 0.14 s a request
after a load on its own thread, 0.21-0.24 s after one on the caller's (2 cores).
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

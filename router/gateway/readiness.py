"""Load the models in the background, so the server answers /healthz at once and /readyz only once it can serve.

A process that is up is not yet a process that can answer: a local pool loads one model replica per worker,
which takes seconds. Warm-up runs off the event loop; until it has finished, completions get a 503 with
``Retry-After`` and /readyz says what is still missing, which is what a load balancer or ``make demo`` waits for.

It runs on the loop's default executor, whose threads live as long as the server, and not on a thread of its own
that ends when loading is done: a thread that ran torch ops and then exits leaves its OpenMP helper threads
spinning, and on two cores that made every later step of transformers' engine (which runs on torch's OpenMP
threads; the packed engine runs on its own) about 40 times slower.
"""

from __future__ import annotations

import asyncio
import threading

from router.sdk import Router


class Readiness:
    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._warming: asyncio.Future[None] | None = None
        self.closing = False

    def start(self, router: Router) -> None:
        """Begin warming up; call from the server's event loop (its lifespan start-up)."""
        self._warming = asyncio.get_running_loop().run_in_executor(None, self._warm, router)

    def mark_ready(self) -> None:
        """For a router whose pools have nothing to load, or that was warmed by its owner."""
        self._done.set()

    def _warm(self, router: Router) -> None:
        try:
            router.warmup()
        except BaseException as exc:  # reported by /readyz and by `serve`, which exits on it
            self._error = exc
        finally:
            self._done.set()

    @property
    def ready(self) -> bool:
        return self._done.is_set() and self._error is None and not self.closing

    def wait(self, timeout_s: float) -> bool:
        """Whether warm-up succeeded within ``timeout_s``; False at once if it failed."""
        self._done.wait(timeout_s)
        return self.ready

    def problem(self) -> str | None:
        """Why the gateway is not ready, or None when it is."""
        if self.closing:
            return "the server is shutting down"
        if not self._done.is_set():
            return "the pools are loading their models"
        if self._error is not None:
            return f"warm-up failed: {type(self._error).__name__}: {self._error}"
        return None

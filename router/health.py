"""Per-pool health: LiteLLM's router semantics, so that a failing upstream costs a few requests, not all of them.

``allowed_fails`` failures in a row (requests that failed in the pool, or health checks) cool the pool down for
``cooldown_s``. While it is cooled down, admission refuses at once with
:class:`~router.errors.PoolUnavailableError`, which the dispatcher turns into the pool's ``fallback`` (or a 503
when it has none): no request waits for a timeout from a server that is known to be down. A success, or a
passing health check, ends the streak and the cooldown.

Health checks run where a pool has something to ask: a remote engine's ``GET {api_base}/models`` (vLLM, SGLang
and ``transformers serve`` all answer it) and a Redis pool's ``PING``. In-process pools need none.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx

from router.config import PoolConfig
from router.errors import PoolUnavailableError
from router.pool import Pool

Probe = Callable[[], bool]


class PoolHealth:
    def __init__(self, name: str, config: PoolConfig, probe: Probe | None = None) -> None:
        self.name = name
        self.allowed_fails = config.health.allowed_fails
        self.cooldown_s = config.health.cooldown_s
        self.check_interval_s = config.health.check_interval_s
        self.probe = probe
        self._fails = 0
        self._cooled_until = 0.0
        self._last_error = ""
        self._check_failed = False
        self._lock = threading.Lock()

    @property
    def cooled_down(self) -> bool:
        return time.monotonic() < self._cooled_until

    def problem(self) -> str | None:
        """Why the pool takes no requests right now, or None."""
        if not self.cooled_down:
            return None
        left = self._cooled_until - time.monotonic()
        return (
            f"pool {self.name!r} is cooled down for {left:.1f}s more after {self._fails} failures ({self._last_error})"
        )

    def report(self) -> str | None:
        """What a readiness check says of the pool: a cooldown, or a failed last health check (which alone does not
        stop admission: one failed check is not ``allowed_fails`` of them)."""
        if self._check_failed and not self.cooled_down:
            return f"pool {self.name!r} failed its last health check ({self._last_error})"
        return self.problem()

    def admit(self) -> None:
        problem = self.problem()
        if problem is not None:
            raise PoolUnavailableError(problem)

    def succeeded(self) -> None:
        with self._lock:
            self._fails, self._cooled_until = 0, 0.0

    def failed(self, error: BaseException | str) -> None:
        with self._lock:
            self._fails += 1
            self._last_error = str(error)[:200]
            if self._fails >= self.allowed_fails:
                self._cooled_until = time.monotonic() + self.cooldown_s

    def check(self) -> None:
        """One health check, counted like a request."""
        if self.probe is None:
            return
        try:
            healthy = self.probe()
        except Exception as exc:  # a probe that cannot even ask is a failed check
            healthy, reason = False, str(exc)
        else:
            reason = "health check failed"
        self._check_failed = not healthy
        if healthy:
            self.succeeded()
        else:
            self.failed(reason)


class HealthChecks:
    """One thread that runs every pool's health checks at its interval, until closed."""

    def __init__(self, health: dict[str, PoolHealth]) -> None:
        self.checked = [h for h in health.values() if h.probe is not None]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health-checks", daemon=True)
        if self.checked:
            self._thread.start()

    def _run(self) -> None:
        due = dict.fromkeys(range(len(self.checked)), 0.0)
        while not self._stop.is_set():
            now = time.monotonic()
            for i, health in enumerate(self.checked):
                if now >= due[i]:
                    health.check()
                    due[i] = time.monotonic() + health.check_interval_s
            self._stop.wait(min(due.values()) - time.monotonic())

    def close(self) -> None:
        self._stop.set()


def probe_for(config: PoolConfig, pool: Pool) -> Probe | None:
    """What to ask to know whether the pool can serve: its engine's model list, its Redis, or nothing."""
    if config.health.check_interval_s is None:
        return None
    available = getattr(pool, "available", None)
    if available is not None:
        return available
    if config.backend == "litellm" and config.api_base:
        url = config.api_base.rstrip("/") + "/models"
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        timeout = min(config.timeout_s, 5.0)
        return lambda: httpx.get(url, headers=headers, timeout=timeout).status_code == 200
    return None

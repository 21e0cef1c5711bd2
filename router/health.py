"""Per-pool health: LiteLLM's router semantics, so that a failing upstream costs a few requests, not all of them.

``allowed_fails`` failures in a row (requests that failed in the pool, or health checks) cool the pool down for
``cooldown_s``. While it is cooled down, admission refuses at once with
:class:`~router.errors.PoolUnavailableError`, which the dispatcher turns into the pool's ``fallback`` (or a 503
when it has none): no request waits for a timeout from a server that is known to be down. A success, or a
passing health check, ends the streak, the cooldown and a failed check's report: a request that went through is
the best health check there is, so readiness returns with the first one rather than at the next probe.

A pool that knows its workers (a Redis pool, through their heartbeats: its ``serving``) cools down only when none
of them serves. Its requests also fail for one worker's fault (a worker killed while holding them), and cooling
the whole pool down for that would turn away every request its other workers could answer. Such failures still
count, so that once its last worker is gone the next failure cools it down, and that cooldown ends at the first
health check that finds a worker serving again.

Health checks run where a pool has something to ask: a remote engine's ``GET {api_base}/models`` (vLLM, SGLang
and ``transformers serve`` all answer it) and a Redis pool's ``PING``. In-process pools need none. A healthy pool
is checked every ``check_interval_s``; one that is cooled down or failed its last check is probed on a back-off
from :data:`FIRST_RETRY_S` up to :data:`MAX_RETRY_S`, so service returns within a second of its Redis or engine.
A passing probe lifts a cooldown when the probe can vouch for what failed: a check had failed, or the requests
failed to reach the pool's transport. A cooldown from requests that reached a pool whose probe passes (an engine
that lists its models but fails completions) runs its full ``cooldown_s``.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

import httpx

from router.config import PoolConfig
from router.errors import PoolUnavailableError
from router.pool import Pool

Probe = Callable[[], bool]
Serving = Callable[[], bool]

FIRST_RETRY_S = 0.1
"""The first probe of a pool that just cooled down or failed a check; each failed probe doubles the wait."""
MAX_RETRY_S = 0.5
"""The longest wait between probes of an unhealthy pool: back within a second of its transport."""


class PoolHealth:
    def __init__(
        self, name: str, config: PoolConfig, probe: Probe | None = None, serving: Serving | None = None
    ) -> None:
        self.name = name
        self.allowed_fails = config.health.allowed_fails
        self.cooldown_s = config.health.cooldown_s
        self.check_interval_s = config.health.check_interval_s
        self.probe = probe
        self.serving = serving
        """Whether any of the pool's workers serves right now, for a pool that can tell (never raises; False when
        it cannot find out); None for pools that cannot, which cool down on their failures alone."""
        self.cooled = threading.Event()
        """Set when the pool cools down, so the health checks probe it at once rather than at their interval; the
        checks give all their pools one event, which they sleep on."""
        self.failures_total = 0
        """Every failure ever counted against the pool; a success resets the streak, never this."""
        self._fails = 0
        self._cooled_until = 0.0
        self._last_error = ""
        self._check_failed = False
        self._probe_vouches = False
        self._lock = threading.Lock()

    @property
    def cooled_down(self) -> bool:
        return time.monotonic() < self._cooled_until

    @property
    def unhealthy(self) -> bool:
        """Cooled down or failing its checks: probed on the back-off instead of the interval."""
        return self._check_failed or self.cooled_down

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
            left = self._cooled_until - time.monotonic()
            raise PoolUnavailableError(problem, retry_after_s=max(1, math.ceil(left)))

    def succeeded(self) -> None:
        with self._lock:
            self._fails, self._cooled_until, self._probe_vouches, self._check_failed = 0, 0.0, False, False

    def failed(self, error: BaseException | str) -> None:
        with self._lock:
            self._fails += 1
            self.failures_total += 1
            self._last_error = str(error)[:200]
            self._probe_vouches = self._probe_vouches or isinstance(error, PoolUnavailableError)
            due = self._fails >= self.allowed_fails
        if not due or self._workers_serve():  # asked outside the lock: it may wait on the pool's transport
            return
        with self._lock:
            if self._fails >= self.allowed_fails:  # no success came in meanwhile
                self._cooled_until = time.monotonic() + self.cooldown_s
                self.cooled.set()

    def _workers_serve(self) -> bool:
        return self.serving is not None and self.serving()

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
        if not healthy:
            self._probe_vouches = True
            self.failed(reason)
        elif self._probe_vouches or not self.cooled_down or self._workers_serve():
            self.succeeded()


class HealthChecks:
    """One thread that runs every pool's health checks: at its interval while healthy, on a back-off while not."""

    def __init__(self, health: dict[str, PoolHealth]) -> None:
        self.checked = [h for h in health.values() if h.probe is not None]
        self._stop = threading.Event()
        self._wake = threading.Event()
        for checked in self.checked:
            checked.cooled = self._wake
        self._thread = threading.Thread(target=self._run, name="health-checks", daemon=True)
        if self.checked:
            self._thread.start()

    def _run(self) -> None:
        due = [0.0] * len(self.checked)
        retry = [FIRST_RETRY_S] * len(self.checked)
        while not self._stop.is_set():
            self._wake.clear()  # before reading the pools: a cooldown from here on wakes the next wait
            for i, health in enumerate(self.checked):
                if health.unhealthy:  # cooled down since it was last checked: probe soon, not at the interval
                    due[i] = min(due[i], time.monotonic() + retry[i])
                if time.monotonic() < due[i]:
                    continue
                health.check()
                if health.unhealthy:
                    due[i], retry[i] = time.monotonic() + retry[i], min(2 * retry[i], MAX_RETRY_S)
                else:
                    due[i], retry[i] = time.monotonic() + health.check_interval_s, FIRST_RETRY_S
            self._wake.wait(max(0.0, min(due) - time.monotonic()))

    def close(self) -> None:
        self._stop.set()
        self._wake.set()


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

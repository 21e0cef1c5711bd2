"""Cooldowns and probes of one pool: what a passing probe may lift, how soon an unhealthy pool is probed again,
the Retry-After a cooled-down pool gives, and why a pool whose workers serve is never cooled down."""

from __future__ import annotations

import time

import pytest

from router.config import PoolConfig
from router.errors import BackendError, PoolTimeoutError, PoolUnavailableError
from router.health import MAX_RETRY_S, HealthChecks, PoolHealth

CONFIG = PoolConfig(backend="autoregressive", model="m", health={"allowed_fails": 2, "cooldown_s": 30})


class Switch:
    """A probe (or a pool's ``serving``) whose answer the test sets, counting how often it is asked."""

    def __init__(self) -> None:
        self.up, self.asked = True, 0

    def __call__(self) -> bool:
        self.asked += 1
        return self.up


def test_a_cooled_down_pool_refuses_with_the_time_left():
    health = PoolHealth("remote", CONFIG)
    health.failed(BackendError("engine said 500"))
    health.admit()  # one failure is not allowed_fails of them
    health.failed(BackendError("engine said 500"))
    with pytest.raises(PoolUnavailableError) as refused:
        health.admit()
    assert refused.value.retry_after_s == 30 and "cooled down for 30.0s more" in refused.value.message


def test_a_passing_probe_lifts_a_cooldown_only_where_it_can_vouch():
    probe = Switch()
    engine = PoolHealth("engine", CONFIG, probe)
    for _ in range(2):  # requests reached the engine and failed there: its model list says nothing of that
        engine.failed(BackendError("engine said 500"))
    engine.check()
    assert engine.cooled_down
    transport = PoolHealth("redis", CONFIG, probe)
    for _ in range(2):  # requests never reached the pool: the probe asks exactly what failed
        transport.failed(PoolUnavailableError("Redis is unreachable"))
    transport.check()
    assert not transport.cooled_down
    probe.up = False
    checked = PoolHealth("redis", CONFIG, probe)
    checked.check()
    checked.check()
    assert checked.cooled_down
    probe.up = True
    checked.check()
    assert not checked.cooled_down and checked.report() is None


def test_an_unhealthy_pool_is_probed_on_a_back_off_and_a_healthy_one_at_its_interval():
    probe = Switch()
    health = PoolHealth(
        "redis", PoolConfig(backend="autoregressive", model="m", health={"check_interval_s": 60}), probe
    )
    checks = HealthChecks({"redis": health})
    try:
        time.sleep(0.5)
        assert probe.asked == 1  # the first check, then nothing for a minute
        probe.up = False
        for _ in range(3):
            health.failed(PoolUnavailableError("Redis is unreachable"))
        time.sleep(2.0)
        failing = probe.asked - 1
        assert failing >= 4  # at once, after 0.1, 0.2 and 0.4 s, then every MAX_RETRY_S
        probe.up = True
        deadline = time.monotonic() + 2 * MAX_RETRY_S
        while health.cooled_down:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        asked = probe.asked
        time.sleep(0.5)
        assert probe.asked == asked  # healthy again: back to its interval
    finally:
        checks.close()


def test_a_pool_whose_workers_serve_is_not_cooled_down_by_failures():
    """A Redis pool's requests fail when the worker holding them dies; while another worker serves, those failures
    are counted but do not turn the pool away. With no worker left they cool it down at once, and the first check
    that finds a worker again ends the cooldown, though a Redis PING cannot vouch for requests that timed out."""
    serving = Switch()
    health = PoolHealth("redis", CONFIG, Switch(), serving=serving)
    for _ in range(5):
        health.failed(PoolTimeoutError("pool 'redis' did not finish within 60s"))
    health.admit()
    assert not health.cooled_down and health.failures_total == 5 and serving.asked == 4  # from allowed_fails on
    serving.up = False
    health.failed(PoolTimeoutError("pool 'redis' did not finish within 60s"))
    with pytest.raises(PoolUnavailableError):
        health.admit()
    health.check()
    assert health.cooled_down  # the probe passes, but still no worker serves
    serving.up = True
    health.check()
    assert not health.cooled_down and health.report() is None


def test_a_success_ends_a_failed_check_and_a_cooldown_at_once():
    """Readiness returns with the first request that goes through, not at the next probe."""
    probe = Switch()
    probe.up = False
    health = PoolHealth("redis", CONFIG, probe)
    health.check()
    assert "failed its last health check" in health.report()
    health.succeeded()
    assert health.report() is None and not health.unhealthy
    health.check()
    health.check()
    assert health.cooled_down
    health.succeeded()
    assert health.report() is None and not health.unhealthy

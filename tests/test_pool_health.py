"""Cooldowns and probes of one pool: what a passing probe may lift, how soon an unhealthy pool is probed again,
and the Retry-After a cooled-down pool gives."""

from __future__ import annotations

import time

import pytest

from router.config import PoolConfig
from router.errors import BackendError, PoolUnavailableError
from router.health import MAX_RETRY_S, HealthChecks, PoolHealth

CONFIG = PoolConfig(backend="autoregressive", model="m", health={"allowed_fails": 2, "cooldown_s": 30})


class Switch:
    """A probe whose answer the test sets, counting how often it is asked."""

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

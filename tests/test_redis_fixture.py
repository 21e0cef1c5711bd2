"""The Redis fixture later suites rely on: a real server, reachable, isolated by its own port or REDIS_URL."""

from __future__ import annotations

import redis


def test_redis_fixture_serves_a_real_server(redis_url):
    client = redis.Redis.from_url(redis_url)
    client.set("dspark:fixture", "ok", ex=30)
    assert client.get("dspark:fixture") == b"ok"
    assert client.info("server")["redis_version"]

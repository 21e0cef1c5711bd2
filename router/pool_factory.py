"""The pool a config entry describes, picked apart from the implementations so neither imports the other."""

from __future__ import annotations

from router.config import PoolConfig
from router.pool import Pool
from router.pools import InProcessPool
from router.redis_pool import RedisPool


def build_pool(name: str, config: PoolConfig) -> Pool:
    """Worker threads in this process, or a queue to ``dspark-router worker`` processes."""
    if config.transport == "redis":
        return RedisPool(name, config)
    return InProcessPool.from_config(name, config)

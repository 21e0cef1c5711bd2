"""Fixtures and helpers the router and litellm suites share (no tests here).

Models: the tiny random llama from conftest for the standard pool, and the same model with fresh DSpark heads for
the DSpark pool. Configs are written as real YAML files and loaded the way users load them.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from backends.autoregressive import AutoregressiveBackend
from backends.dspark.model import DSparkModel
from backends.types import GenerationRequest
from benchmarks.local_redis import free_port
from router import Router
from router.pool import Pool

MESSAGES = [{"role": "user", "content": "def parse(value):"}]


class MetadataScorer:
    """A real, deterministic scorer: the score a request carries in ``metadata.p`` (0.0 when absent)."""

    def score(self, request: dict[str, Any]) -> float:
        return float((request.get("metadata") or {}).get("p", 0.0))


@pytest.fixture(scope="session")
def router_models(tiny_model_paths, tmp_path_factory) -> dict[str, Path]:
    """``standard``: the tiny llama; ``dspark``: the same weights with three fresh span heads."""
    dspark = tmp_path_factory.mktemp("router-models") / "dspark"
    DSparkModel.with_new_heads(AutoregressiveBackend.from_pretrained(tiny_model_paths["llama"]).loaded, 3).save(dspark)
    return {"dspark": dspark, "standard": tiny_model_paths["llama"]}


def config_data(models: dict[str, Path], **policy: Any) -> dict[str, Any]:
    """Two local pools on the tiny models; ``policy`` keys replace the defaults (no classifier, default standard).
    One request at a time per pool (``max_batch: 1``), so a held request fills its pool; batching has its own
    tests."""
    one = {"workers": 1, "max_batch": 1, "max_queue": 4}
    return {
        "pools": {
            "dspark": {"backend": "dspark", "model": str(models["dspark"]), **one},
            "standard": {"backend": "autoregressive", "model": str(models["standard"]), **one},
        },
        "policy": {"classifier": None, "default_pool": "standard", **policy},
    }


def write_config(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def make_router(tmp_path: Path, data: dict[str, Any], **kwargs: Any) -> Router:
    return Router.from_config(write_config(tmp_path / "router.yaml", data), **kwargs)


def copy_model(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def closed_port_base() -> str:
    """An api_base nobody listens on: the port was free a moment ago and is closed now."""
    return f"http://127.0.0.1:{free_port()}/v1"


@contextmanager
def saturated_pool(pool: Pool) -> Iterator[None]:
    """Hold a pool at capacity: its requests wait on a gate inside their first chunk until released."""
    gate = threading.Event()
    request = GenerationRequest(messages=MESSAGES, max_tokens=4)
    held = [pool.submit(request, on_chunk=lambda _: gate.wait(10)) for _ in range(pool.capacity)]
    try:
        yield
    finally:
        gate.set()
        for future in held:
            future.result(timeout=30)


def saturated(router: Router, pool_name: str):
    """:func:`saturated_pool` for one of a router's pools."""
    return saturated_pool(router.pools[pool_name])

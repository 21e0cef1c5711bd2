"""Fixtures the gateway suites share (no tests here): real uvicorn servers on free loopback ports, in threads.

One router on the tiny models serves the session's main gateway (no keys, default limits); tests that need other
settings start their own gateway on the same router, which costs a few milliseconds since the models are loaded.
"""

# ruff: noqa: F811 - the shared fixtures are imported by name and then requested as arguments

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from router import Router
from router.gateway.app import create_app
from router.gateway.settings import GatewayConfig
from tests.test_router_support import config_data, free_port, make_router, router_models  # noqa: F401

RULES = [
    {"name": "structured", "pool": "dspark", "match": {"response_format": ["json_object", "json_schema"]}},
    {"name": "tools", "pool": "dspark", "match": {"tools": True}},
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def settings(**values: Any) -> GatewayConfig:
    """Gateway settings that ignore the environment's keys, so a developer's DSPARK_ROUTER_API_KEYS changes nothing."""
    return GatewayConfig(**{"api_keys_env": None, **values})


class Server:
    """uvicorn serving an app on a free loopback port, in a thread of this process."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name=f"uvicorn-{self.port}", daemon=True)

    def __enter__(self) -> Server:
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *_: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=20)

    def wait_ready(self, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while httpx.get(f"{self.url}/readyz").status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("the gateway did not become ready")
            time.sleep(0.02)


def serve(router: Router, **values: Any) -> Server:
    """A gateway over ``router`` with these settings; the router is already warm, so it is ready at once."""
    return Server(create_app(router, settings(**values), warmup=False))


@pytest.fixture(scope="session")
def decision_log(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gateway") / "decisions.jsonl"


@pytest.fixture(scope="session")
def gateway_router(router_models, decision_log, tmp_path_factory) -> Iterator[Router]:
    """Both tiny pools, rules for structured output and tools, a decision log; loaded before the first request."""
    data = {**config_data(router_models, rules=RULES), "log": {"jsonl": str(decision_log)}}
    with make_router(tmp_path_factory.mktemp("gateway-config"), data) as router:
        router.warmup()
        yield router


@pytest.fixture(scope="session")
def gateway(gateway_router) -> Iterator[Server]:
    """The main gateway: through create_app's own background warm-up, as `serve` runs it."""
    with Server(create_app(gateway_router, settings())) as server:
        server.wait_ready()
        yield server


@pytest.fixture(scope="session")
def base_url(gateway) -> str:
    return f"{gateway.url}/v1"

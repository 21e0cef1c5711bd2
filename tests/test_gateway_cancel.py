"""A client that disconnects stops its generation within a step or so, and its pool slot is free again at once.

The standard pool's model counts its own forward passes (a forward hook on the real model), so "stopped early" is
measured, not inferred: a request for 480 tokens that is abandoned a few passes in ends far short of 480.
"""

# ruff: noqa: F811 - the shared fixtures are imported by name and then requested as arguments

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest

from backends.types import GenerationRequest
from router import Router
from router.config import PoolConfig, load_config
from router.pools import InProcessPool, load_backend
from tests.test_gateway_support import router_models, serve  # noqa: F401
from tests.test_router_support import MESSAGES, config_data, write_config

LONG = {"model": "dspark-router/standard", "messages": MESSAGES, "max_tokens": 480, "temperature": 0}
# Passes a request may still make after its client is gone: the step in flight, plus scheduling slack on busy cores.
SLACK = 40


class Passes:
    """Counts the passes, each taking at least ``STEP_S``: as long as a real model's step would, rather than the
    tiny model's fraction of a millisecond, so "within a few passes" measures how fast a disconnect reaches the
    decoder, not whether a toy model can outrun the event loop."""

    STEP_S = 0.002

    def __init__(self) -> None:
        self.count = 0

    def hook(self, *_: object) -> None:
        self.count += 1
        time.sleep(self.STEP_S)


def eventually(condition: Callable[[], bool], timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.002)


@pytest.fixture
def counted(tmp_path, router_models) -> Iterator[tuple[Router, Passes]]:
    """A router whose standard pool's model counts its forward passes."""
    passes = Passes()
    config = load_config(write_config(tmp_path / "router.yaml", config_data(router_models)))

    def loader(name: str, pool: PoolConfig) -> Callable:
        def load():
            backend = load_backend(pool)
            if name == "standard":
                backend.loaded.model.base_model.register_forward_hook(passes.hook)
            return backend

        return load

    pools = {
        name: InProcessPool(name, c.backend, loader(name, c), workers=c.workers, max_queue=c.max_queue)
        for name, c in config.pools.items()
    }
    with Router(config, pools=pools) as router:
        router.warmup()
        yield router, passes


def send_raw(port: int, body: dict) -> socket.socket:
    """A request on a socket of its own, so the test decides when the connection goes away."""
    data = json.dumps(body).encode()
    head = "POST /v1/chat/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(f"{head}content-length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def stream_closed(router: Router) -> float:
    labels = {"pool": "standard", "type": "stream_closed"}
    return router.metrics.registry.get_sample_value("dspark_router_errors_total", labels) or 0.0


def assert_stopped_early(router: Router, passes: Passes, at_disconnect: int) -> None:
    pool = router.pools["standard"]
    eventually(lambda: pool.depth == 0)
    assert passes.count - at_disconnect <= SLACK
    assert passes.count < LONG["max_tokens"] // 4
    assert stream_closed(router) == 1


def test_a_disconnect_stops_a_completion(counted):
    router, passes = counted
    with serve(router) as server:
        sock = send_raw(server.port, LONG)
        eventually(lambda: passes.count >= 5)
        sock.close()
        at_disconnect = passes.count
        assert_stopped_early(router, passes, at_disconnect)
        gateway = server.app.state.gateway
        eventually(lambda: gateway.metrics.disconnects._value.get() == 1)
        reused = httpx.post(f"{server.url}/v1/chat/completions", json={**LONG, "max_tokens": 3})
        assert reused.status_code == 200 and reused.json()["usage"]["completion_tokens"] == 3
        assert (gateway.limit.running, router.pools["standard"].depth) == (0, 0)


def test_a_disconnect_stops_a_stream(counted):
    router, passes = counted
    with serve(router) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        stream = client.chat.completions.create(**LONG, stream=True)
        chunks = iter(stream)
        assert next(chunks).choices[0].delta.role == "assistant"
        next(chunks)
        stream.close()
        at_disconnect = passes.count
        assert_stopped_early(router, passes, at_disconnect)
        eventually(lambda: server.app.state.gateway.limit.running == 0)


def test_a_queued_request_leaves_the_queue_without_running(counted):
    router, passes = counted
    pool, gate = router.pools["standard"], threading.Event()
    held = pool.submit(GenerationRequest(messages=MESSAGES, max_tokens=2), on_chunk=lambda _: gate.wait(10))
    with serve(router) as server:
        sock = send_raw(server.port, LONG)
        eventually(lambda: pool.depth == 2)
        before = passes.count
        sock.close()
        eventually(lambda: pool.depth == 1)
        gate.set()
        held.result(timeout=10)
        eventually(lambda: pool.depth == 0)
        assert passes.count - before <= 3  # the held request's passes only; the cancelled one never ran


async def test_the_sdk_cancels_an_abandoned_acomplete(counted):
    router, passes = counted
    call = asyncio.ensure_future(router.acomplete(**LONG))
    while passes.count < 5:
        await asyncio.sleep(0.002)
    call.cancel()
    at_cancel = passes.count
    with pytest.raises(asyncio.CancelledError):
        await call
    await asyncio.to_thread(assert_stopped_early, router, passes, at_cancel)

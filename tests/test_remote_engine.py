"""A pool served by a real OpenAI-compatible engine, ``transformers serve --continuous-batching`` on loopback:
tokens stream through, and when the engine is killed the pool cools down and its traffic goes to the fallback."""

# ruff: noqa: F811 - the shared fixtures are imported by name and then requested as arguments

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from router import Router
from tests.test_router_support import config_data, free_port, router_models, write_config  # noqa: F401

MESSAGES = [{"role": "user", "content": "def parse(value):"}]


@pytest.fixture
def engine(router_models, tmp_path):
    """``transformers serve`` on the tiny model, on a free port; yields (process, api_base)."""
    binary = Path(sys.executable).with_name("transformers")
    assert binary.exists(), "transformers' console script is missing from the test environment"
    port = free_port()
    log = (tmp_path / "engine.log").open("w")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [str(binary), "serve", "--continuous-batching", "--host", "127.0.0.1", "--port", str(port)]
    process = subprocess.Popen([*command, str(router_models["standard"])], stdout=log, stderr=log, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "engine.log").read_text()[-2000:]
        time.sleep(0.2)
    yield process, f"{base}/v1"
    if process.poll() is None:
        process.kill()
    process.wait(timeout=10)


def test_remote_engine_streams_then_cools_down_to_the_fallback_when_killed(tmp_path, router_models, engine):
    process, api_base = engine
    data = config_data(router_models, fallback={"remote": "standard"})
    data["pools"]["remote"] = {
        "backend": "litellm",
        "model": f"openai/{router_models['standard']}",
        "api_base": api_base,
        "api_key": "none",
        "timeout_s": 30,
        "health": {"allowed_fails": 2, "cooldown_s": 60, "check_interval_s": 0.5},
    }
    with Router.from_config(write_config(tmp_path / "router.yaml", data)) as router:
        answer = router.complete(messages=MESSAGES, max_tokens=16, temperature=0, model="remote")
        assert (answer.decision.pool, answer.usage.completion_tokens) == ("remote", 16)
        chunks = list(router.stream(messages=MESSAGES, max_tokens=16, temperature=0, model="remote"))
        deltas = [c.delta for c in chunks if c.delta]
        assert len(deltas) > 1 and "".join(deltas) == chunks[-1].result.text  # streamed through, token by token
        assert router.unavailable() == {}

        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)
        first = router.complete(messages=MESSAGES, max_tokens=4, temperature=0, model="remote")
        assert (first.decision.pool, first.decision.fell_back) == ("standard", True)  # tried, failed, fell back
        deadline = time.monotonic() + 10
        while "remote" not in router.unavailable():  # the failure plus failed health checks cool it down
            assert time.monotonic() < deadline, "the dead engine was never cooled down"
            time.sleep(0.1)
        assert "cooled down" in router.unavailable()["remote"]
        cooled = router.complete(messages=MESSAGES, max_tokens=4, temperature=0, model="remote")
        assert (cooled.decision.pool, cooled.decision.fell_back) == ("standard", True)
        assert "cooled down" in cooled.decision.reason  # not tried at all: no timeout paid
        assert cooled.text == first.text

"""A pool served by a real OpenAI-compatible engine, ``transformers serve --continuous-batching`` on loopback:
tokens stream through, and when the engine is killed the pool cools down and its traffic goes to the fallback."""

# ruff: noqa: F811 - the shared fixtures are imported by name and then requested as arguments

from __future__ import annotations

import signal
import time

import pytest

from benchmarks.local_serve import transformers_serve
from router import Router
from tests.test_router_support import config_data, router_models, write_config  # noqa: F401

MESSAGES = [{"role": "user", "content": "def parse(value):"}]


@pytest.fixture
def engine(router_models):
    """``transformers serve`` on the tiny model, on a free port; yields (process, api_base)."""
    with transformers_serve(router_models["standard"], threads=1, start_timeout_s=120) as served:
        yield served


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
        assert (answer.decision.pool, answer.usage.completion_tokens) == ("remote", 16), answer.decision.reason
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

"""The litellm backend over real HTTP: an OpenAI-compatible server on loopback, backed by a tiny local model."""

# ruff: noqa: F811 - the shared fixtures are imported by name and then requested as arguments

from __future__ import annotations

import json
import threading
import time
import uuid
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse

from backends.autoregressive import AutoregressiveBackend
from backends.errors import DSparkRouterError, InvalidRequestError
from backends.types import GenerationRequest, GenerationResult
from router.litellm_backend import LiteLLMBackend, _finish_reason
from tests.test_router_support import (  # noqa: F401
    MESSAGES,
    closed_port_base,
    config_data,
    free_port,
    make_router,
    router_models,
)

TOO_LONG = [{"role": "user", "content": "word " * 600}]
pytestmark = pytest.mark.filterwarnings("ignore:.*ReadOnly.*:UserWarning")  # litellm's own types, on first use


def openai_app(backend: AutoregressiveBackend, seen: list[dict[str, Any]]) -> FastAPI:
    """POST /v1/chat/completions, plain and SSE, the way vLLM or any OpenAI-compatible server answers it."""
    app = FastAPI()

    def usage(result: GenerationResult) -> dict[str, int]:
        u = result.usage
        return {
            "prompt_tokens": u.prompt_tokens,
            "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens,
        }

    def finish(result: GenerationResult) -> str:
        return "stop" if result.finish_reason == "eos" else result.finish_reason

    @app.post("/v1/chat/completions")
    async def chat(body: dict[str, Any]):
        seen.append(body)
        meta = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": body["model"]}
        try:
            request = GenerationRequest(
                messages=body["messages"],
                max_tokens=body.get("max_tokens", 16),
                temperature=body.get("temperature", 0.0),
                top_p=body.get("top_p", 1.0),
                top_k=body.get("top_k", 0),
                seed=body.get("seed"),
                stop=body.get("stop"),
            )
            if not body.get("stream"):
                result = await backend.acomplete(request)
        except InvalidRequestError as exc:
            return JSONResponse(exc.to_openai(), status_code=400)
        if not body.get("stream"):
            message = {"role": "assistant", "content": result.text}
            choice = {"index": 0, "message": message, "finish_reason": finish(result)}
            return {**meta, "object": "chat.completion", "choices": [choice], "usage": usage(result)}

        async def events():
            def event(choices: list[dict[str, Any]], **extra: Any) -> str:
                return (
                    f"data: {json.dumps({**meta, 'object': 'chat.completion.chunk', 'choices': choices, **extra})}\n\n"
                )

            async for chunk in backend.astream(request):
                reason = finish(chunk.result) if chunk.result else None
                delta = {"role": "assistant", "content": chunk.delta}
                yield event([{"index": 0, "delta": delta, "finish_reason": reason}])
                if chunk.result and (body.get("stream_options") or {}).get("include_usage"):
                    yield event([], usage=usage(chunk.result))
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def server(tiny_model_paths):
    """The server in a thread on a free port; yields its api_base, its model and the request bodies it saw."""
    backend = AutoregressiveBackend.from_pretrained(tiny_model_paths["llama"])
    seen: list[dict[str, Any]] = []
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(openai_app(backend, seen), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not uv.started:
        assert time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.02)
    yield {"api_base": f"http://127.0.0.1:{port}/v1", "backend": backend, "seen": seen}
    uv.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def remote(server) -> LiteLLMBackend:
    return LiteLLMBackend("openai/tiny", api_base=server["api_base"], api_key="sk-test", timeout_s=30)


def test_complete_over_http_matches_the_local_model(server, remote):
    request = GenerationRequest(messages=MESSAGES, max_tokens=6, temperature=0.0)
    expected = server["backend"].complete(request)
    result = remote.complete(request)
    assert result.text == expected.text
    assert result.usage == expected.usage
    assert result.finish_reason == ("stop" if expected.finish_reason == "eos" else expected.finish_reason)
    assert result.stats.wall_time_s > 0 and result.stats.tokens_per_s > 0


def test_stream_over_http(server, remote):
    request = GenerationRequest(messages=MESSAGES, max_tokens=6, temperature=0.0)
    chunks = list(remote.stream(request))
    result = chunks[-1].result
    assert "".join(c.delta for c in chunks) == result.text == server["backend"].complete(request).text
    assert result.usage.completion_tokens == 6 and result.finish_reason == "length"
    assert 0 < result.stats.time_to_first_token_s <= result.stats.wall_time_s


async def test_async_over_http(server, remote):
    request = GenerationRequest(messages=MESSAGES, max_tokens=5, temperature=0.0)
    expected = server["backend"].complete(request).text
    assert (await remote.acomplete(request)).text == expected
    chunks = [c async for c in remote.astream(request)]
    assert "".join(c.delta for c in chunks) == chunks[-1].result.text == expected


def test_sampling_arguments_reach_the_server(server, remote):
    remote.complete(GenerationRequest(messages=MESSAGES, max_tokens=3, seed=11, stop=["\n\n"], top_k=5, top_p=0.9))
    body = server["seen"][-1]
    sent = (body["seed"], body["stop"], body["top_k"], body["top_p"], body["max_tokens"], body["temperature"])
    assert sent == (11, ["\n\n"], 5, 0.9, 3, 1.0)  # an unset temperature goes out as OpenAI's default


def test_a_refused_request_stays_a_request_error(remote):
    with pytest.raises(InvalidRequestError, match="refused"):
        remote.complete(GenerationRequest(messages=TOO_LONG, max_tokens=4, temperature=0.0))


def test_a_closed_port_is_a_backend_error_at_once():
    backend = LiteLLMBackend("openai/tiny", api_base=closed_port_base(), api_key="sk-test", timeout_s=30)
    started = time.monotonic()
    with pytest.raises(DSparkRouterError) as info:
        backend.complete(GenerationRequest(messages=MESSAGES, max_tokens=4, temperature=0.0))
    assert info.value.to_openai()["error"]["type"] == "backend_error"
    assert time.monotonic() - started < 10


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("stop", "stop"),
        ("eos", "stop"),
        ("length", "length"),
        ("tool_calls", "tool_calls"),
        ("function_call", "tool_calls"),
        (None, "stop"),
    ],
)
def test_finish_reasons_map_to_the_shared_ones(given, expected):
    assert _finish_reason(given) == expected


def test_router_pool_served_over_litellm(tmp_path, router_models, server):
    data = config_data(router_models)
    data["pools"]["standard"] = {
        "backend": "litellm",
        "model": "openai/tiny",
        "api_base": server["api_base"],
        "api_key": "sk-test",
    }
    with make_router(tmp_path, data) as router:
        result = router.complete(messages=MESSAGES, max_tokens=4, temperature=0)
        assert result.decision.pool == "standard" and result.measured.mean_accepted_tokens is None
        local = server["backend"].complete(GenerationRequest(messages=MESSAGES, max_tokens=4, temperature=0.0))
        assert result.text == local.text
        streamed = list(router.stream(messages=MESSAGES, max_tokens=4, temperature=0))
        assert streamed[-1].result.text == result.text


def test_fallback_from_a_litellm_pool_on_a_closed_port(tmp_path, router_models):
    data = config_data(router_models, fallback={"remote": "standard"}, default_pool="remote")
    data["pools"]["remote"] = {
        "backend": "litellm",
        "model": "openai/tiny",
        "api_base": closed_port_base(),
        "api_key": "x",
    }
    with make_router(tmp_path, data) as router:
        result = router.complete(messages=MESSAGES, max_tokens=4)
        assert (result.decision.policy_pool, result.decision.pool, result.decision.fell_back) == (
            "remote",
            "standard",
            True,
        )
        assert "Connection error" in result.decision.reason

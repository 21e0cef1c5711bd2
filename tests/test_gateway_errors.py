"""Every refusal the gateway makes, one test per status, each in OpenAI's error shape: what the client sent wrong
(400, 404, 413), who it is (401), how much it asks (429 with Retry-After), and when (503 until the models load)."""

# ruff: noqa: F811 - the shared fixtures are imported by name and then requested as arguments

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import httpx
import openai
import pytest

from backends.types import GenerationRequest
from router import Router
from router.config import load_config
from router.errors import ModelNotFoundError
from router.gateway.app import create_app
from router.gateway.settings import ApiKey
from router.pools import InProcessPool, load_backend
from tests.test_gateway_support import (  # noqa: F401
    Server,
    base_url,
    decision_log,
    gateway,
    gateway_router,
    router_models,
    serve,
    settings,
)
from tests.test_router_support import MESSAGES, config_data, make_router, saturated, write_config

CHAT = {"model": "dspark-router/auto", "messages": MESSAGES, "max_tokens": 2}


def error_of(response: httpx.Response, status: int) -> dict:
    """The error object, after checking the status and that the body is OpenAI's shape and nothing more."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def post(url: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", **kwargs)


def test_malformed_json_is_400(gateway):
    error = error_of(post(gateway.url, content=b'{"messages": [', headers={"content-type": "application/json"}), 400)
    assert error["type"] == "invalid_request_error" and "not valid JSON" in error["message"]
    error = error_of(post(gateway.url, content=b"\xff\xfe", headers={"content-type": "application/json"}), 400)
    assert "not valid JSON" in error["message"]
    assert "JSON object" in error_of(post(gateway.url, json=[CHAT]), 400)["message"]


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"temperature": 5}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 3}, "n"),
        ({"frobnicate": True}, "frobnicate"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"uniqueItems": True}}}},
            "response_format",
        ),
    ],
)
def test_an_invalid_field_is_400_naming_it(base_url, change, param):
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**CHAT, extra_body=change)
    assert info.value.status_code == 400 and info.value.body["param"] == param


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "x", "messages": MESSAGES}, "messages"),
        ("/v1/completions", {"max_tokens": 2}, "prompt"),
        ("/v1/chat/completions", {"messages": MESSAGES, "prompt": "x"}, "prompt"),
        ("/v1/chat/completions", {"messages": MESSAGES, "stream": "yes"}, "stream"),
        ("/v1/chat/completions", {"messages": MESSAGES, "request_id": "mine"}, "request_id"),
    ],
)
def test_each_endpoint_takes_its_own_input(gateway, path, body, param):
    assert error_of(httpx.post(f"{gateway.url}{path}", json=body), 400)["param"] == param


def test_framework_validation_is_400_never_422(gateway_router):
    app = create_app(gateway_router, settings(), warmup=False)

    @app.get("/typed")
    async def typed(n: int) -> dict:
        return {"n": n}

    with Server(app) as server:
        error = error_of(httpx.get(f"{server.url}/typed", params={"n": "many"}), 400)
        assert error["param"] == "query.n"
        assert error_of(httpx.get(f"{server.url}/v1/nowhere"), 404)["code"] == "not_found"
        assert error_of(httpx.delete(f"{server.url}/v1/models"), 405)["code"] == "method_not_allowed"


def test_a_lone_surrogate_is_400_not_a_crash(gateway, gateway_router):
    body = b'{"messages": [{"role": "user", "content": "caf\\udcff"}], "max_tokens": 2}'
    error = error_of(post(gateway.url, content=body, headers={"content-type": "application/json"}), 400)
    assert error["param"] == "messages.0.content" and "lone surrogate" in error["message"]
    routing = b'{"messages": [{"role": "user", "content": "hi"}], "user": "\\ud800"}'
    assert (
        error_of(post(gateway.url, content=routing, headers={"content-type": "application/json"}), 400)["param"]
        == "user"
    )
    with pytest.raises(ValueError, match="lone surrogate"):
        gateway_router.complete(messages=[{"role": "user", "content": "caf\udcff"}], max_tokens=2)


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_a_seed_no_generator_takes_is_400_and_leaves_every_pool_serving(gateway, seed):
    """Refused before it reaches a pool: sent more often than a pool's failure budget, and to each pool, it must
    not cool any of them down for the requests that follow."""
    for model in ("dspark-router/dspark", "dspark-router/standard", "dspark-router/auto") * 2:
        error = error_of(post(gateway.url, json={**CHAT, "model": model, "temperature": 1.0, "seed": seed}), 400)
        assert error["param"] == "seed" and str(seed) in error["message"]
    assert httpx.get(f"{gateway.url}/readyz").status_code == 200
    for model in ("dspark-router/dspark", "dspark-router/standard"):
        assert post(gateway.url, json={**CHAT, "model": model, "seed": 2**64 - 1}).status_code == 200


@pytest.mark.parametrize("model", [5, ["dspark-router/auto"], {"name": "x"}, True])
def test_a_model_that_is_not_a_string_is_400_naming_it(gateway, model):
    assert error_of(post(gateway.url, json={**CHAT, "model": model}), 400)["param"] == "model"
    assert error_of(post(gateway.url, json={**CHAT, "model": model, "stream": True}), 400)["param"] == "model"
    assert error_of(httpx.post(f"{gateway.url}/v1/route", json={**CHAT, "model": model}), 400)["param"] == "model"
    routed = {**CHAT, "metadata": {"route": 7}}
    assert error_of(post(gateway.url, json=routed), 400)["param"] == "metadata.route"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"max_tokens": "10"}, "max_tokens"),
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"seed": "7"}, "seed"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream_options": {"include_usage": True}, "stream": False}, "stream_options"),
        ({"tool_choice": 5}, "tool_choice"),
        ({"tool_choice": ["required"]}, "tool_choice"),
        ({"messages": [*MESSAGES, {"role": "tool", "content": "sunny"}]}, f"messages.{len(MESSAGES)}.tool_call_id"),
        (
            {"messages": [*MESSAGES, {"role": "tool", "content": "x", "tool_call_id": ""}]},
            f"messages.{len(MESSAGES)}.tool_call_id",
        ),
    ],
)
def test_what_openai_refuses_is_400_naming_the_field(gateway, extra, param):
    assert error_of(post(gateway.url, json={**CHAT, **extra}), 400)["param"] == param


def test_an_image_part_is_400_naming_the_part(gateway):
    parts = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    error = error_of(post(gateway.url, json={**CHAT, "messages": [{"role": "user", "content": parts}]}), 400)
    assert (
        error["param"] == "messages.0.content" and "content[1]" in error["message"] and "image_url" in error["message"]
    )


def test_an_unknown_model_is_404_model_not_found(base_url, gateway_router):
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(**{**CHAT, "model": "gpt-4o"})
    assert info.value.code == "model_not_found" and info.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    with pytest.raises(ModelNotFoundError):
        gateway_router.route(**{**CHAT, "model": "gpt-4o"})


def test_a_body_over_the_cap_is_413_before_it_is_read(gateway_router):
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 2000}]}
    with serve(gateway_router, max_body_bytes=1024) as server:
        assert error_of(post(server.url, json=big), 413)["code"] == "payload_too_large"

        def chunked():  # no Content-Length: the cap is enforced while reading
            yield b'{"messages": [{"role": "user", "content": "'
            yield b"x" * 2000
            yield b'"}]}'

        assert error_of(post(server.url, content=chunked()), 413)["code"] == "payload_too_large"
        assert post(server.url, json=CHAT).status_code == 200


@pytest.mark.parametrize("size", [5 << 20, 64 << 20])
def test_a_client_that_sends_its_whole_body_before_reading_still_gets_the_413(gateway_router, size):
    """urllib (and curl without Expect) write every byte before reading the answer: a server that answers and
    closes while the body still arrives resets the connection, and the client never sees why."""
    body = b'{"messages": [{"role": "user", "content": "' + b"x" * size + b'"}]}'
    with serve(gateway_router) as server:
        request = urllib.request.Request(
            f"{server.url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=60)
        assert refused.value.code == 413
        assert json.loads(refused.value.read())["error"]["code"] == "payload_too_large"
        assert post(server.url, json=CHAT).status_code == 200


def test_keys_are_required_once_configured(gateway_router, monkeypatch):
    monkeypatch.setenv("GATEWAY_TEST_KEYS", "sk-from-env, sk-second")
    keys = [ApiKey(key="sk-from-config", name="ci")]
    with serve(gateway_router, api_keys=keys, api_keys_env="GATEWAY_TEST_KEYS") as server:
        assert error_of(post(server.url, json=CHAT), 401)["code"] == "invalid_api_key"
        wrong = {"authorization": "Bearer sk-from-confiG"}
        assert "incorrect" in error_of(post(server.url, json=CHAT, headers=wrong), 401)["message"]
        assert error_of(httpx.get(f"{server.url}/v1/models"), 401)["type"] == "invalid_request_error"
        for key in ("sk-from-config", "sk-second"):
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
            greedy = client.chat.completions.create(**CHAT, temperature=0)  # sampled, it may end at EOS first
            assert greedy.usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-guess", max_retries=0).models.list()
        assert httpx.get(f"{server.url}/healthz").status_code == 200  # probes stay open for load balancers


def test_a_key_over_its_rate_is_429_with_retry_after(gateway_router):
    keys = [ApiKey(key="sk-slow", requests_per_minute=2), ApiKey(key="sk-free")]
    with serve(gateway_router, api_keys=keys) as server:
        slow, free = ({"authorization": f"Bearer {key}"} for key in ("sk-slow", "sk-free"))
        assert [httpx.get(f"{server.url}/v1/models", headers=slow).status_code for _ in range(2)] == [200, 200]
        limited = httpx.get(f"{server.url}/v1/models", headers=slow)
        assert error_of(limited, 429)["code"] == "rate_limit_exceeded"
        assert 1 <= int(limited.headers["retry-after"]) <= 30  # one request's worth at 2 per minute
        assert httpx.get(f"{server.url}/v1/models", headers=free).status_code == 200


def test_full_pools_are_429_with_retry_after(gateway, gateway_router):
    with saturated(gateway_router, "dspark"), saturated(gateway_router, "standard"):
        response = post(gateway.url, json=CHAT)
        assert error_of(response, 429)["type"] == "queue_full_error" and response.headers["retry-after"] == "1"
    assert post(gateway.url, json=CHAT).status_code == 200


def test_the_gateway_queues_up_to_its_limit_then_refuses(gateway_router):
    """One completion runs (held behind a busy worker), one waits for its slot, the next is refused at once."""
    pool, gate = gateway_router.pools["standard"], threading.Event()
    held = pool.submit(GenerationRequest(messages=MESSAGES, max_tokens=2), on_chunk=lambda _: gate.wait(10))
    with serve(gateway_router, max_concurrency=1, max_waiting=1) as server:
        limit = server.app.state.gateway.limit
        results: list[httpx.Response] = []
        callers = [threading.Thread(target=lambda: results.append(post(server.url, json=CHAT))) for _ in range(2)]
        for caller in callers:
            caller.start()
        deadline = time.monotonic() + 10
        while (limit.running, limit.waiting) != (1, 1) and time.monotonic() < deadline:
            time.sleep(0.01)
        refused = post(server.url, json=CHAT)
        assert error_of(refused, 429)["code"] == "rate_limit_exceeded" and "busy" in refused.json()["error"]["message"]
        assert refused.headers["retry-after"] == "1"
        gate.set()
        for caller in callers:
            caller.join(timeout=30)
    held.result(timeout=10)
    assert [r.status_code for r in results] == [200, 200]


def test_not_ready_is_503_until_the_models_are_loaded(tmp_path, router_models):
    """Warm-up that takes its time: completions and /readyz say 503 (with Retry-After) until it is done."""
    loading = threading.Event()
    config = load_config(write_config(tmp_path / "router.yaml", config_data(router_models)))

    def slow(pool_config):
        return lambda: loading.wait(30) and load_backend(pool_config)

    pools = {
        name: InProcessPool(name, c.backend, slow(c), workers=c.workers, max_queue=c.max_queue)
        for name, c in config.pools.items()
    }
    with Router(config, pools=pools) as router, Server(create_app(router, settings())) as server:
        ready = httpx.get(f"{server.url}/readyz")
        assert ready.status_code == 503 and ready.json()["problem"] == "the pools are loading their models"
        response = post(server.url, json=CHAT)
        assert error_of(response, 503)["code"] == "not_ready" and response.headers["retry-after"] == "1"
        assert httpx.get(f"{server.url}/healthz").status_code == 200
        loading.set()
        server.wait_ready()
        assert post(server.url, json=CHAT).status_code == 200


def test_a_failed_warmup_stays_503_and_says_why(tmp_path, router_models):
    data = config_data(router_models)
    data["pools"]["dspark"]["model"] = str(tmp_path)  # a folder, so the config loads, but no model in it
    with make_router(tmp_path, data) as router, Server(create_app(router, settings())) as server:
        eventually_ready = time.monotonic() + 30
        while (problem := httpx.get(f"{server.url}/readyz").json()["problem"]).startswith("the pools are loading"):
            assert time.monotonic() < eventually_ready
            time.sleep(0.02)
        assert problem.startswith("warm-up failed: ModelLoadError") and "holds no model" in problem
        assert error_of(post(server.url, json=CHAT), 503)["code"] == "not_ready"


def test_a_failure_after_the_first_chunk_ends_the_stream_with_an_error_event(tmp_path, router_models):
    """The status line is long sent by then: the error travels as an event, which the openai SDK raises."""
    data = config_data(router_models)
    data["pools"]["standard"]["timeout_s"] = 0.2  # far less than 480 tokens take, far more than the first
    with make_router(tmp_path, data) as router, serve(router) as server:
        router.warmup()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        stream = client.chat.completions.create(
            messages=MESSAGES, model="auto", max_tokens=480, temperature=0, stream=True
        )
        received = []
        with pytest.raises(openai.APIError, match=r"did not finish within 0\.2s"):
            for chunk in stream:
                received.append(chunk)
        assert len(received) > 2 and received[0].choices[0].delta.role == "assistant"


def test_a_bug_is_500_without_a_stack_trace(gateway_router):
    app = create_app(gateway_router, settings(), warmup=False)

    @app.get("/broken")
    async def broken() -> None:
        raise RuntimeError("secret internals")

    with Server(app) as server:
        error = error_of(httpx.get(f"{server.url}/broken", headers={"x-request-id": "bug-1"}), 500)
    assert error["type"] == "server_error" and "secret" not in error["message"] and "Traceback" not in error["message"]

"""The gateway through the openai SDK, on a real uvicorn server, checked against the same Router called in-process.

Greedy decoding makes the two comparable token for token, so every answer over HTTP must equal the in-process
answer: text, token counts, tool calls, the decision.
"""

# ruff: noqa: F811 - the shared fixtures are imported by name and then requested as arguments

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.test_gateway_support import (  # noqa: F401
    WEATHER,
    base_url,
    decision_log,
    gateway,
    gateway_router,
    router_models,
)
from tests.test_router_support import MESSAGES

GREEDY = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0}
WEATHER_CALL = {
    "model": "dspark-router/auto",
    "messages": [{"role": "user", "content": "Weather in Porto?"}],
    "tools": [WEATHER],
    "tool_choice": "required",
    "temperature": 0,
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)


def test_chat_completion_equals_the_in_process_result(client, gateway_router):
    expected = gateway_router.complete(**GREEDY)
    completion = client.chat.completions.create(model="dspark-router/auto", **GREEDY)
    choice = completion.choices[0]
    assert choice.message.content == expected.text and choice.message.role == "assistant"
    assert choice.finish_reason == expected.finish_reason == "length"
    assert completion.usage.completion_tokens == len(expected.token_ids) == 6
    assert completion.usage.prompt_tokens == expected.usage.prompt_tokens
    assert completion.model == "dspark-router/standard"
    dspark = completion.usage.model_extra["dspark"]
    assert dspark == {
        "mean_accepted_tokens": 1.0,
        "forward_passes": 6,
        "forced_tokens": 0,
        "traffic_rounds": 0,
        "datastore_rounds": 0,
        "tree_rounds": 0,
    }
    assert completion.model_extra["dspark_router"]["decision"]["rule"] == "default"


def test_stream_with_usage_ends_with_the_usage_of_the_streamed_tokens(client, gateway_router):
    expected = gateway_router.complete(**{**GREEDY, "max_tokens": 12}, model="dspark")
    stream = client.chat.completions.create(
        model="dspark-router/dspark",
        **{**GREEDY, "max_tokens": 12},
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    *body, finish, usage = chunks
    assert finish.choices[0].finish_reason == "length" and usage.choices == [] and usage.usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    streamed = "".join(c.choices[0].delta.content or "" for c in body)
    assert streamed == expected.text
    assert usage.usage.completion_tokens == len(expected.token_ids) == 12
    assert usage.usage.model_extra["dspark"]["forward_passes"] == expected.stats.forward_passes
    assert len({c.id for c in chunks}) == 1 and chunks[0].model == "dspark-router/dspark"


def test_json_schema_output_validates(client):
    completion = client.chat.completions.create(
        model="dspark-router/auto",
        messages=[{"role": "user", "content": "Who is it? Elena, 31."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
        max_tokens=64,
        temperature=0,
    )
    jsonschema.validate(json.loads(completion.choices[0].message.content), PERSON)
    assert completion.choices[0].finish_reason == "stop" and completion.model == "dspark-router/dspark"


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_tool_call_comes_back_as_tool_calls(client, tool_choice):
    completion = client.chat.completions.create(
        model="dspark-router/auto",
        messages=[{"role": "user", "content": "Weather in Porto?"}],
        tools=[WEATHER],
        tool_choice=tool_choice,
        max_tokens=96,
        temperature=0,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_a_streamed_tool_call_arrives_as_tool_call_deltas(client):
    args = {**WEATHER_CALL, "max_tokens": 96}
    whole = client.chat.completions.create(**args).choices[0].message.tool_calls[0]
    chunks = list(client.chat.completions.create(**args, stream=True))
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    deltas = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    assert deltas[0].id != whole.id  # the same call made again is a new call: agent frameworks drop repeated ids
    assert "".join(d.function.arguments or "" for d in deltas) == whole.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_tool_call_cut_by_max_tokens_is_still_a_call(client):
    """As OpenAI answers it: the call with the arguments written so far, no content, finish_reason length."""
    args = {**WEATHER_CALL, "max_tokens": 8}
    whole = client.chat.completions.create(**args).choices[0]
    assert whole.finish_reason == "length" and whole.message.content is None
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    with pytest.raises(json.JSONDecodeError):
        json.loads(call.function.arguments)
    chunks = list(client.chat.completions.create(**args, stream=True))
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "length"


def test_raw_response_headers_carry_the_decision_and_the_request_id(client, decision_log):
    raw = client.chat.completions.with_raw_response.create(
        model="dspark-router/auto", **GREEDY, extra_headers={"x-request-id": "agent-42.step-3"}
    )
    assert raw.headers["x-request-id"] == "agent-42.step-3"
    assert (raw.headers["x-dspark-pool"], raw.headers["x-dspark-rule"]) == ("standard", "default")
    assert raw.headers["x-dspark-score"] == "none"
    completion = raw.parse()
    assert completion.id == "chatcmpl-agent-42.step-3" and completion._request_id == "agent-42.step-3"
    records = [json.loads(line) for line in decision_log.read_text().splitlines()]
    assert any(r["request_id"] == "agent-42.step-3" and r["decision"]["pool"] == "standard" for r in records)
    fresh = client.chat.completions.with_raw_response.create(model="dspark-router/auto", **GREEDY)
    assert len(fresh.headers["x-request-id"]) == 32


def test_content_as_text_parts_is_the_joined_text(client):
    parts = [{"type": "text", "text": "def parse("}, {"type": "text", "text": "value):"}]
    joined = client.chat.completions.create(
        model="auto", messages=[{"role": "user", "content": "def parse(\nvalue):"}], max_tokens=6, temperature=0
    )
    from_parts = client.chat.completions.create(
        model="auto", messages=[{"role": "user", "content": parts}], max_tokens=6, temperature=0
    )
    assert from_parts.choices[0].message.content == joined.choices[0].message.content


def test_text_completions_plain_and_streamed(client, gateway_router):
    expected = gateway_router.complete(prompt="def f(x):", max_tokens=8, temperature=0)
    completion = client.completions.create(model="dspark-router/auto", prompt="def f(x):", max_tokens=8, temperature=0)
    assert completion.choices[0].text == expected.text and completion.object == "text_completion"
    assert completion.usage.prompt_tokens == expected.usage.prompt_tokens
    stream = client.completions.create(
        model="dspark-router/auto",
        prompt="def f(x):",
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-2].choices[0].finish_reason == "length"


def test_models_list_the_route_hints(client):
    assert [m.id for m in client.models.list()] == [
        "dspark-router/auto",
        "dspark-router/dspark",
        "dspark-router/standard",
    ]
    assert client.models.retrieve("dspark-router/dspark").owned_by == "dspark-router"


def test_route_is_the_decision_without_generating(gateway, gateway_router):
    body = {"messages": MESSAGES, "tools": [WEATHER]}
    response = httpx.post(f"{gateway.url}/v1/route", json=body)
    assert response.status_code == 200 and response.headers["x-dspark-rule"] == "tools"
    assert response.json() == gateway_router.route(**body).model_dump(mode="json")


def test_metrics_and_health(gateway):
    metrics = httpx.get(f"{gateway.url}/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    assert 'dspark_router_decisions_total{pool="standard",rule="default"}' in metrics.text
    assert 'dspark_router_gateway_responses_total{endpoint="/v1/chat/completions",status="200"}' in metrics.text
    assert httpx.get(f"{gateway.url}/healthz").json() == {"status": "ok"}
    ready = httpx.get(f"{gateway.url}/readyz").json()
    assert ready["ready"] and ready["pools"]["dspark"] == {"depth": 0, "capacity": 5}


def test_a_request_id_that_is_not_a_plain_token_is_replaced(gateway):
    for given in ("two words", "x" * 129):
        response = httpx.post(f"{gateway.url}/v1/route", json={"messages": MESSAGES}, headers={"x-request-id": given})
        assert response.status_code == 200 and response.headers["x-request-id"] != given
        assert len(response.headers["x-request-id"]) == 32

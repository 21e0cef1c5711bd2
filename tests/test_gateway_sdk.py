"""What the gateway needed from the SDK's shared parsing, which every SDK caller now gets too: text parts, refused
media parts and lone surrogates named by field, a text completion's ``prompt``, 404 ``model_not_found``, and a
caller's own request id."""

# ruff: noqa: F811 - the shared fixtures are imported by name and then requested as arguments

from __future__ import annotations

import json

import pytest

from backends.errors import InvalidRequestError
from backends.types import GenerationRequest
from router.errors import ModelNotFoundError
from tests.test_gateway_support import decision_log, gateway_router, router_models  # noqa: F401
from tests.test_router_support import MESSAGES


def refusal(**args) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        GenerationRequest(**args)
    return info.value


def test_text_parts_are_read_as_one_text(gateway_router):
    parts = [{"type": "text", "text": "def parse("}, {"type": "text", "text": "value):"}]
    request = GenerationRequest(messages=[{"role": "user", "content": parts}])
    assert request.messages[0].content == "def parse(\nvalue):"
    joined = gateway_router.complete(
        messages=[{"role": "user", "content": "def parse(\nvalue):"}], max_tokens=5, temperature=0
    )
    from_parts = gateway_router.complete(messages=[{"role": "user", "content": parts}], max_tokens=5, temperature=0)
    assert (from_parts.text, from_parts.usage) == (joined.text, joined.usage)


@pytest.mark.parametrize("kind", ["image_url", "input_audio", "file"])
def test_a_part_no_model_here_can_read_is_refused_by_index_and_type(kind):
    parts = [{"type": "text", "text": "look:"}, {"type": kind, kind: {}}]
    error = refusal(messages=[{"role": "user", "content": parts}])
    assert error.param == "messages.0.content" and f"content[1] is of type {kind!r}" in error.message


@pytest.mark.parametrize(
    ("args", "param"),
    [
        ({"messages": [{"role": "user", "content": "caf\udcff"}]}, "messages.0.content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
            "messages.0.content.0.text",
        ),
        ({"prompt": "x", "stop": ["\udc80"]}, "stop.0"),
        ({"prompt": "x", "tools": [{"type": "function", "function": {"name": "f\udcff"}}]}, "tools.0.function.name"),
    ],
)
def test_a_lone_surrogate_is_refused_where_it_is(args, param):
    error = refusal(**args)
    assert error.param == param and "lone surrogate" in error.message


def test_routing_arguments_are_checked_for_surrogates_too(gateway_router):
    with pytest.raises(InvalidRequestError) as info:
        gateway_router.route(messages=MESSAGES, metadata={"tenant": "t\udcff"})
    assert info.value.param == "metadata.tenant"


def test_prompt_is_a_text_completion(gateway_router):
    result = gateway_router.complete(prompt="def f(x):", max_tokens=3, temperature=0)
    assert result.usage.completion_tokens == 3 and result.decision.pool == "standard"
    assert gateway_router.route(prompt="def f(x):").rule == "default"
    with pytest.raises(InvalidRequestError) as info:
        gateway_router.complete(max_tokens=3)
    assert info.value.param == "messages"
    with pytest.raises(InvalidRequestError, match="either prompt or messages"):
        gateway_router.complete(prompt="x", messages=MESSAGES)


def test_an_unknown_model_is_model_not_found(gateway_router):
    with pytest.raises(ModelNotFoundError) as info:
        gateway_router.route(messages=MESSAGES, model="dspark-router/turbo")
    error = info.value.to_openai()["error"]
    assert (info.value.status_code, error["code"], error["param"]) == (404, "model_not_found", "model")
    assert "dspark-router/auto, dspark-router/dspark, dspark-router/standard" in error["message"]
    with pytest.raises(InvalidRequestError) as routed:
        gateway_router.route(messages=MESSAGES, metadata={"route": "turbo"})
    assert not isinstance(routed.value, ModelNotFoundError) and routed.value.status_code == 400


def test_a_callers_request_id_names_the_result_and_its_record(gateway_router, decision_log):
    result = gateway_router.complete(messages=MESSAGES, max_tokens=2, request_id="sdk-7")
    assert result.request_id == "sdk-7"
    records = [json.loads(line) for line in decision_log.read_text().splitlines()]
    assert [r["decision"]["pool"] for r in records if r["request_id"] == "sdk-7"] == ["standard"]

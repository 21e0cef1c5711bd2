"""Property-based fuzzing of the chat request surface over real HTTP: whatever a client puts in any field, of any
type, the gateway answers without a 5xx, every refusal is OpenAI's error shape naming a field the body has, and no
request, however wrong, counts against a pool's health.

schemathesis (test_gateway_schema) walks what the OpenAPI document says; this walks what it does not: values of
the wrong type in every field, numbers past every range, nested junk, several fields wrong at once. Bounded:
derandomized, a fixed number of examples, ``max_tokens`` a handful unless it is the field under test.
"""

# ruff: noqa: F811 - the shared fixtures are imported by name and then requested as arguments

from __future__ import annotations

import json
import re

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_gateway_support import WEATHER, decision_log, gateway, gateway_router, router_models  # noqa: F401

BASE = {"model": "dspark-router/auto", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3}

# Any JSON value: what a client with a bug, or a hostile one, can send in a field.
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False, width=64),
    st.text(max_size=12),
    st.sampled_from(["", "auto", "none", "required", "json_object", "user", "dspark-router/dspark", "\u0000"]),
)
JSON = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=8,
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "developer", "wizard"])},
    optional={
        "content": JSON,
        "tool_call_id": JSON,
        "tool_calls": st.lists(
            st.fixed_dictionaries(
                {"id": JSON, "type": st.just("function") | JSON},
                optional={"function": st.fixed_dictionaries({"name": JSON, "arguments": st.text(max_size=8) | JSON})},
            ),
            max_size=2,
        )
        | JSON,
        "name": JSON,
    },
)
# Each field: any JSON at all, or values near its own rules (right type, edges of its range, its real shapes).
FIELDS = {
    "model": JSON,
    "messages": st.lists(MESSAGE, max_size=3) | JSON,
    "max_tokens": st.integers(min_value=-5, max_value=40) | JSON,
    "temperature": st.floats(min_value=-1, max_value=3) | JSON,
    "top_p": st.floats(min_value=-0.5, max_value=1.5) | JSON,
    "top_k": st.integers(min_value=-3, max_value=100) | JSON,
    "seed": st.integers(min_value=-(2**65), max_value=2**65) | JSON,
    "stop": st.lists(st.text(max_size=3), max_size=6) | JSON,
    "n": JSON,
    "stream": st.booleans() | JSON,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | JSON,
    "response_format": st.sampled_from(
        [{"type": "json_object"}, {"type": "text"}, {"type": "json_schema", "json_schema": {"schema": {}}}]
    )
    | JSON,
    "tools": st.just([WEATHER]) | st.lists(JSON, max_size=2) | JSON,
    "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function", "function": {"name": "x"}}])
    | JSON,
    "metadata": st.fixed_dictionaries({"route": JSON}) | JSON,
    "logprobs": JSON,
    "user": JSON,
}
BODIES = st.dictionaries(st.sampled_from(sorted(FIELDS)), st.none(), min_size=1, max_size=4).flatmap(
    lambda chosen: st.fixed_dictionaries({name: FIELDS[name] for name in chosen})
)


def field_of(param: str) -> str:
    """The top-level field an error's ``param`` points into: ``messages.0.role`` is in ``messages``."""
    return re.split(r"[.\[]", param, maxsplit=1)[0]


@settings(
    max_examples=200,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(changes=BODIES)
def test_no_request_is_a_server_error_and_none_touches_a_pools_health(gateway, gateway_router, changes):
    body = {**BASE, **changes}
    failures = {name: health.failures_total for name, health in gateway_router.health.items()}
    with httpx.Client(timeout=60) as client:
        response = client.post(f"{gateway.url}/v1/chat/completions", content=json.dumps(body))
    assert response.status_code < 500, (body, response.text)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error
        assert isinstance(error["param"], str) and field_of(error["param"]) in body, (body, error)
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert "server_error" not in response.text and response.text.rstrip().endswith("data: [DONE]"), response.text
    else:
        assert response.json()["choices"], response.text
    assert {name: health.failures_total for name, health in gateway_router.health.items()} == failures, body
    assert gateway_router.unavailable() == {}

"""litellm into the router: ``litellm.completion(model="dspark-router/...")`` runs through a Router in this process."""

# ruff: noqa: F811 - the shared fixtures are imported by name and then requested as arguments

from __future__ import annotations

import pytest

from router.litellm_backend import import_litellm
from router.litellm_provider import register
from tests.test_router_support import MESSAGES, config_data, make_router, router_models, saturated  # noqa: F401

litellm = import_litellm()
pytestmark = pytest.mark.filterwarnings("ignore:.*ReadOnly.*:UserWarning")  # litellm's own types, on first use


@pytest.fixture(scope="module")
def router(router_models, tmp_path_factory):
    rules = [{"name": "tools", "pool": "dspark", "match": {"tools": True}}]
    router = make_router(tmp_path_factory.mktemp("provider"), config_data(router_models, rules=rules))
    register(router)
    yield router
    router.close()


def decision(response) -> dict:
    return response.choices[0].message.provider_specific_fields["dspark_router"]


def test_completion_runs_through_the_router(router):
    expected = router.complete(messages=MESSAGES, max_tokens=5, temperature=0)
    response = litellm.completion(model="dspark-router/auto", messages=MESSAGES, max_tokens=5, temperature=0)
    assert response.choices[0].message.content == expected.text
    assert response.choices[0].finish_reason == "length"
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (expected.usage.prompt_tokens, 5)
    assert (decision(response)["pool"], decision(response)["rule"]) == ("standard", "default")


@pytest.mark.parametrize(
    ("kwargs", "pool", "rule"),
    [
        ({"model": "dspark-router/dspark"}, "dspark", "hint"),
        ({"model": "dspark-router/standard"}, "standard", "hint"),
        ({"model": "dspark-router/auto", "metadata": {"route": "dspark"}}, "dspark", "hint"),
        (
            {"model": "dspark-router/auto", "tools": [{"type": "function", "function": {"name": "f"}}]},
            "dspark",
            "tools",
        ),
    ],
)
def test_model_names_metadata_and_arguments_steer_the_route(router, kwargs, pool, rule):
    response = litellm.completion(messages=MESSAGES, max_tokens=2, **kwargs)
    assert (decision(response)["pool"], decision(response)["rule"]) == (pool, rule)


def test_user_becomes_the_tenant(router):
    response = litellm.completion(model="dspark-router/auto", messages=MESSAGES, max_tokens=2, user="alice")
    assert decision(response)["tenant"] == "alice"


def test_streaming(router):
    expected = router.complete(messages=MESSAGES, max_tokens=6, temperature=0, model="dspark").text
    chunks = list(
        litellm.completion(model="dspark-router/dspark", messages=MESSAGES, max_tokens=6, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_async_completion_and_streaming(router):
    expected = router.complete(messages=MESSAGES, max_tokens=4, seed=7).text  # seeded sampling: one draw each way
    response = await litellm.acompletion(model="dspark-router/auto", messages=MESSAGES, max_tokens=4, seed=7)
    assert response.choices[0].message.content == expected
    stream = await litellm.acompletion(model="dspark-router/auto", messages=MESSAGES, max_tokens=4, seed=7, stream=True)
    assert "".join([c.choices[0].delta.content or "" async for c in stream]) == expected


def test_router_errors_reach_litellm_callers_as_its_own_types(router):
    """litellm maps an exception's ``status_code``; every router error carries the right one."""
    with pytest.raises(litellm.NotFoundError, match="gpu"):  # model_not_found, a 404 as in OpenAI's API
        litellm.completion(model="dspark-router/gpu", messages=MESSAGES, max_tokens=2)
    with pytest.raises(litellm.BadRequestError, match="n=3"):
        litellm.completion(model="dspark-router/auto", messages=MESSAGES, max_tokens=2, n=3)
    with saturated(router, "dspark"), pytest.raises(litellm.RateLimitError, match="full"):
        litellm.completion(model="dspark-router/dspark", messages=MESSAGES, max_tokens=2)


def test_router_metrics_see_litellm_traffic(router):
    before = router.metrics.registry.get_sample_value(
        "dspark_router_decisions_total", {"pool": "dspark", "rule": "hint"}
    )
    litellm.completion(model="dspark-router/dspark", messages=MESSAGES, max_tokens=2)
    after = router.metrics.registry.get_sample_value(
        "dspark_router_decisions_total", {"pool": "dspark", "rule": "hint"}
    )
    assert after == (before or 0) + 1

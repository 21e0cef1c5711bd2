"""The routing policy, through ``Router.route`` (a dry run: nothing is generated or loaded)."""

# ruff: noqa: F811 - the shared fixtures are imported by name and then requested as arguments

from __future__ import annotations

import pytest

from backends.errors import InvalidRequestError
from router.errors import ConfigError, RoutingError
from tests.test_router_support import MESSAGES, MetadataScorer, config_data, make_router, router_models  # noqa: F401

RULES = [
    {"name": "tools", "pool": "dspark", "match": {"tools": True}},
    {"name": "hot", "pool": "standard", "match": {"temperature": {"min": 0.8}}},
    {"name": "json", "pool": "dspark", "match": {"response_format": ["json_object", "json_schema"]}},
    {"name": "story", "pool": "standard", "match": {"prompt_regex": "(?i)\\bstory\\b"}},
    {"name": "tagged", "pool": "dspark", "match": {"tags": ["extract", "fast"]}},
]
# Agents' requests here decode greedily unless a case says otherwise, so the "hot" rule fires only when asked.
GREEDY = {"temperature": 0.0}
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
JSON = {"type": "json_object"}


@pytest.fixture
def policy_router(tmp_path, router_models):
    data = config_data(router_models, rules=RULES, classifier=None, defaults=GREEDY)
    router = make_router(tmp_path, data, scorer=MetadataScorer())
    yield router
    router.close()


@pytest.mark.parametrize(
    ("args", "rule", "pool"),
    [
        ({"tools": TOOLS}, "tools", "dspark"),
        ({"tools": TOOLS, "temperature": 1.0}, "tools", "dspark"),  # first match wins
        ({"temperature": 1.0, "response_format": JSON}, "hot", "standard"),
        ({"response_format": JSON}, "json", "dspark"),
        ({"messages": [{"role": "user", "content": "Write a Story"}], "response_format": JSON}, "json", "dspark"),
        ({"messages": [{"role": "user", "content": "Write a Story"}]}, "story", "standard"),
        ({"messages": [{"role": "user", "content": "history"}]}, "classifier", "standard"),
        ({"metadata": {"tags": ["fast", "extract", "x"]}}, "tagged", "dspark"),
        ({"metadata": {"tags": ["fast"]}}, "classifier", "standard"),
    ],
)
def test_rules_fire_in_order(policy_router, args, rule, pool):
    decision = policy_router.route(**{"messages": MESSAGES, **args})
    assert (decision.rule, decision.pool) == (rule, pool)


def test_regex_looks_at_the_last_user_message(policy_router):
    messages = [
        {"role": "user", "content": "tell me a story"},
        {"role": "assistant", "content": "Once upon a time"},
        {"role": "user", "content": "now list the characters"},
    ]
    assert policy_router.route(messages=messages).rule == "classifier"


@pytest.mark.parametrize(("p", "pool"), [(0.0, "standard"), (0.49, "standard"), (0.5, "dspark"), (0.97, "dspark")])
def test_threshold_splits_on_the_classifier_score(policy_router, p, pool):
    decision = policy_router.route(messages=MESSAGES, metadata={"p": p})
    assert (decision.rule, decision.pool, decision.score) == ("classifier", pool, p)
    assert f"threshold {0.5:.3f}" in decision.reason


@pytest.mark.parametrize(
    "hint", [{"model": "dspark-router/dspark"}, {"model": "dspark"}, {"metadata": {"route": "dspark", "p": 0.0}}]
)
def test_route_hints_win_over_rules_and_score(policy_router, hint):
    decision = policy_router.route(messages=MESSAGES, temperature=1.5, **hint)
    assert (decision.rule, decision.pool) == ("hint", "dspark")


def test_auto_model_is_no_hint(policy_router):
    assert policy_router.route(messages=MESSAGES, model="dspark-router/auto").rule == "classifier"


@pytest.mark.parametrize(
    ("args", "param"),
    [
        ({"model": "gpt-4o"}, "model"),
        ({"metadata": {"route": "gpu"}}, "metadata.route"),
        ({"model": "dspark-router/dspark", "metadata": {"route": "standard"}}, "model"),
        ({"n": 2}, "n"),
        ({"logprobs": True}, "logprobs"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"metadata": {"tags": "a"}}, "metadata.tags"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_bad_arguments_are_refused_by_name(policy_router, args, param):
    with pytest.raises(InvalidRequestError) as info:
        policy_router.route(**{"messages": MESSAGES, **args})
    assert info.value.param == param


def test_no_op_openai_arguments_are_accepted(policy_router):
    decision = policy_router.route(
        messages=MESSAGES, n=1, presence_penalty=0, frequency_penalty=0.0, logprobs=False, parallel_tool_calls=True
    )
    assert decision.rule == "classifier"


def test_explore_sends_a_seeded_share_to_the_other_pool(tmp_path, router_models):
    def explored(seed: int) -> list[bool]:
        data = config_data(router_models, explore=0.25, seed=seed, default_pool="standard")
        router = make_router(tmp_path, data, scorer=None)
        try:
            decisions = [router.route(messages=MESSAGES) for _ in range(200)]
        finally:
            router.close()
        for d in decisions:
            assert d.policy_pool == "standard"
            assert d.pool == ("dspark" if d.explored else "standard")
        return [d.explored for d in decisions]

    first = explored(seed=7)
    assert 25 <= sum(first) <= 75
    assert explored(seed=7) == first
    assert explored(seed=8) != first


def test_rules_are_never_explored(tmp_path, router_models):
    router = make_router(tmp_path, config_data(router_models, rules=RULES, explore=0.5), scorer=None)
    assert not any(router.route(messages=MESSAGES, tools=TOOLS).explored for _ in range(50))
    router.close()


def test_tenant_overrides(tmp_path, router_models):
    tenants = {
        "acme": {"threshold": 0.9, "rules": [{"name": "acme-all", "pool": "standard", "match": {"tools": True}}]},
        "globex": {"threshold": 0.1},
    }
    data = config_data(router_models, rules=RULES, tenants=tenants, defaults=GREEDY)
    router = make_router(tmp_path, data, scorer=MetadataScorer())
    assert router.route(messages=MESSAGES, tools=TOOLS, user="acme").rule == "acme-all"
    assert router.route(messages=MESSAGES, tools=TOOLS, metadata={"tenant": "globex"}).rule == "tools"
    assert router.route(messages=MESSAGES, metadata={"p": 0.5}, user="acme").pool == "standard"
    assert router.route(messages=MESSAGES, metadata={"p": 0.2, "tenant": "globex"}).pool == "dspark"
    decision = router.route(messages=MESSAGES, metadata={"p": 0.5}, user="initech")
    assert (decision.pool, decision.tenant) == ("dspark", "initech")
    router.close()


class CalibratedScorer(MetadataScorer):
    """A scorer that carries the threshold it was calibrated to route at, as DeterminismClassifier does."""

    threshold = 0.2


@pytest.mark.parametrize(
    ("policy", "p", "pool"),
    [
        ({}, 0.19, "standard"),
        ({}, 0.2, "dspark"),  # no threshold in the config: the scorer's own
        ({"threshold": 0.5}, 0.3, "standard"),  # the config's wins
        ({"tenants": {"acme": {"threshold": 0.5}}}, 0.3, "standard"),
    ],
)
def test_without_a_configured_threshold_the_scorer_sets_it(tmp_path, router_models, policy, p, pool):
    router = make_router(tmp_path, config_data(router_models, **policy), scorer=CalibratedScorer())
    decision = router.route(messages=MESSAGES, metadata={"p": p}, user="acme")
    assert (decision.rule, decision.pool) == ("classifier", pool)
    router.close()


class MiscalibratedScorer(MetadataScorer):
    threshold = 1.5


def test_a_scorer_threshold_outside_0_1_is_refused_at_start(tmp_path, router_models):
    with pytest.raises(ConfigError, match=r"threshold 1\.5 is not a number in \[0, 1\]") as error:
        make_router(tmp_path, config_data(router_models), scorer=MiscalibratedScorer())
    assert error.value.param == "policy.classifier"


def test_without_classifier_or_default_the_request_cannot_be_placed(tmp_path, router_models):
    router = make_router(tmp_path, config_data(router_models, default_pool=None), scorer=None)
    with pytest.raises(RoutingError, match="default_pool"):
        router.route(messages=MESSAGES)
    router.close()


class BrokenScorer:
    def score(self, request):
        return 1.7


def test_an_out_of_range_score_is_a_routing_error(tmp_path, router_models):
    router = make_router(tmp_path, config_data(router_models), scorer=BrokenScorer())
    with pytest.raises(RoutingError, match=r"\[0, 1\]"):
        router.route(messages=MESSAGES)
    router.close()


def test_default_classifier_is_used_when_it_loads_else_rules_then_default_pool(tmp_path, router_models):
    """``classifier: default`` never stops the router: without a usable shipped classifier it routes by rules."""
    router = make_router(tmp_path, config_data(router_models, classifier="default", rules=RULES, defaults=GREEDY))
    decision = router.route(messages=MESSAGES)
    if router.policy.scorer is None:
        assert decision.rule == "default"
    else:
        assert decision.rule == "classifier"
        assert 0.0 <= decision.score <= 1.0
    assert router.route(messages=MESSAGES, tools=TOOLS).rule == "tools"
    router.close()


def test_a_named_classifier_file_must_load(tmp_path, router_models):
    with pytest.raises(ConfigError) as info:
        make_router(tmp_path, config_data(router_models, classifier="no-such-classifier.skops"))
    assert info.value.param == "policy.classifier"

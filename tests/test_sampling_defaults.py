"""An unset temperature or top_p means OpenAI's 1.0 everywhere: decoding, rules, features, records; a configured
default (policy or pool) is the only way to another value, and the decision record shows the value used."""

# ruff: noqa: F811 - the shared fixtures are imported by name and then requested as arguments

from __future__ import annotations

import json

import pytest

from backends.errors import InvalidRequestError
from classifiers.request_rows import structure
from router.errors import ConfigError
from router.litellm_backend import import_litellm
from router.litellm_provider import register
from tests.test_router_support import config_data, make_router, router_models  # noqa: F401

# A prompt on which the tiny random model's sampled continuations differ from seed to seed (checked below).
MESSAGES = [{"role": "user", "content": "Summarise in one sentence: a workshop in Lisbon."}]
HOT = {"name": "hot", "pool": "dspark", "match": {"temperature": {"min": 1.0}}}


def texts(router, seeds, **args) -> list[str]:
    return [router.complete(messages=MESSAGES, max_tokens=12, seed=seed, **args).text for seed in seeds]


def test_unset_temperature_samples_at_openai_default(tmp_path, router_models):
    with make_router(tmp_path, config_data(router_models)) as router:
        unset = texts(router, [1, 2, 1])
        assert unset[0] != unset[1]  # two seeds, two samples
        assert unset[0] == unset[2]  # and a seed reproduces its sample
        assert unset[:2] == texts(router, [1, 2], temperature=1.0)  # the same draws as an explicit 1.0
        greedy = texts(router, [1, 2], temperature=0)
        assert greedy[0] == greedy[1]
        result = router.complete(messages=MESSAGES, max_tokens=4)
        assert (result.decision.sampling.temperature, result.decision.sampling.top_p) == (1.0, 1.0)


def test_unset_temperature_is_1_for_rules_and_features(tmp_path, router_models):
    with make_router(tmp_path, config_data(router_models, rules=[HOT])) as router:
        assert router.route(messages=MESSAGES).rule == "hot"
        assert router.route(messages=MESSAGES, temperature=0.5).rule == "default"
    assert structure({"messages": MESSAGES}) == structure({"messages": MESSAGES, "temperature": 1})
    assert structure({"messages": MESSAGES})["greedy"] == 0.0


def test_pool_default_makes_it_greedy_and_the_record_shows_it(tmp_path, router_models):
    data = config_data(router_models, rules=[HOT])
    data["pools"]["dspark"]["defaults"] = {"temperature": 0}
    data["log"] = {"jsonl": str(tmp_path / "decisions.jsonl")}
    with make_router(tmp_path, data) as router:
        assert router.route(messages=MESSAGES).sampling.temperature == 0.0  # the preview shows it too
        greedy = [router.complete(messages=MESSAGES, max_tokens=12, seed=seed) for seed in (1, 2)]
        assert greedy[0].text == greedy[1].text
        assert [r.decision.rule for r in greedy] == ["hot", "hot"]  # the rule saw 1.0: the pool is chosen after it
        assert greedy[0].decision.sampling.temperature == 0.0
        explicit = router.complete(messages=MESSAGES, max_tokens=12, seed=1, temperature=1.0, model="dspark")
        assert explicit.decision.sampling.temperature == 1.0  # a client's value wins over the pool's default
        standard = router.complete(messages=MESSAGES, max_tokens=4, model="standard")
        assert standard.decision.sampling.temperature == 1.0  # the other pool has no default
    records = [json.loads(line) for line in (tmp_path / "decisions.jsonl").read_text().splitlines()]
    assert [r["decision"]["sampling"]["temperature"] for r in records] == [0.0, 0.0, 1.0, 1.0]


def test_policy_default_is_applied_before_routing(tmp_path, router_models):
    data = config_data(router_models, rules=[HOT], defaults={"temperature": 0, "max_tokens": 5})
    with make_router(tmp_path, data) as router:
        decision = router.route(messages=MESSAGES)
        assert (decision.rule, decision.sampling.temperature, decision.sampling.max_tokens) == ("default", 0.0, 5)
        assert router.route(messages=MESSAGES, temperature=1.0).rule == "hot"
        result = router.complete(messages=MESSAGES)
        assert result.usage.completion_tokens <= 5


def test_pool_max_tokens_cap(tmp_path, router_models):
    data = config_data(router_models)
    data["pools"]["standard"]["max_tokens"] = 8
    with make_router(tmp_path, data) as router:
        assert router.route(messages=MESSAGES).sampling.max_tokens == 8  # an unset max_tokens stays within the cap
        assert router.route(messages=MESSAGES, max_tokens=6).sampling.max_tokens == 6
        with pytest.raises(InvalidRequestError, match="cap of 8") as refused:
            router.complete(messages=MESSAGES, max_completion_tokens=9)
        assert refused.value.param == "max_tokens"
    data["policy"]["defaults"] = {"max_tokens": 9}
    with pytest.raises(ConfigError, match="cap of 8"):
        make_router(tmp_path, data)


@pytest.mark.filterwarnings("ignore:.*ReadOnly.*:UserWarning")
def test_litellm_provider_agrees(tmp_path, router_models):
    litellm = import_litellm()
    with make_router(tmp_path, config_data(router_models)) as router:
        register(router)
        responses = [
            litellm.completion(model="dspark-router/auto", messages=MESSAGES, max_tokens=12, seed=seed)
            for seed in (1, 2)
        ]
        assert [r.choices[0].message.content for r in responses] == texts(router, [1, 2])
        sampling = responses[0].choices[0].message.provider_specific_fields["dspark_router"]["sampling"]
        assert sampling["temperature"] == 1.0

"""The router learns each template's speedup from its answers: a cold template is judged by the classifier, a
repeated one DSpark never answered is sent there to be measured, and what was measured moves the expected speedup,
per template and per tenant."""

# ruff: noqa: F811 - the shared fixtures are imported by name and then requested as arguments

from __future__ import annotations

from itertools import pairwise

import pytest

from router.config import PolicyConfig
from router.expected_time import LoadEstimator, PoolCost, PoolSide
from router.policy import Policy
from router.request import parse_openai_args
from router.templates import MAX_TEMPLATES, MIN_MEASURED, PROBE_AFTER, REPROBE_AFTER, TemplateSpeeds, blended
from tests.test_router_support import config_data, make_router, router_models  # noqa: F401
from tests.test_routing_load import CURVE, IDLE, POOLS, GainScorer

SYSTEM = {"role": "system", "content": "You turn support tickets into one-line summaries."}
COLD = 0.8
"""What the classifier expects of every request here: DSpark slower, so a cold template goes to standard."""


def _routed(content: str, tenant: str | None = None, system: dict | None = SYSTEM):
    messages = [*([system] if system else []), {"role": "user", "content": content}]
    body = {"messages": messages, "metadata": {"gain": COLD}, "max_tokens": 64}
    if tenant:
        body["user"] = tenant
    return parse_openai_args(body, POOLS)


def _policy(templates: TemplateSpeeds) -> Policy:
    estimator = LoadEstimator(
        PoolSide("dspark", lambda: IDLE, PoolCost(sps=CURVE)), PoolSide("standard", lambda: IDLE, PoolCost(sps=CURVE))
    )
    return Policy(PolicyConfig(objective="time_saved"), GainScorer(), estimator, templates)


def test_a_template_is_its_scope_system_prompt_schema_and_tools_not_its_content():
    assert _routed("ticket one").template == _routed("ticket two, other words").template
    assert _routed("ticket one").template != _routed("ticket one", tenant="acme").template
    other = {"role": "system", "content": "You translate tickets."}
    assert _routed("ticket one").template != _routed("ticket one", system=other).template
    assert _routed("ticket one", system=None).template is None
    schema = {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "object"}}}
    with_schema = parse_openai_args({"messages": [{"role": "user", "content": "x"}], "response_format": schema}, POOLS)
    assert with_schema.template is not None


def test_a_cold_template_is_judged_by_the_classifier_then_probed_then_routed_by_what_it_measured():
    templates = TemplateSpeeds("dspark", "standard")
    chosen = _policy(templates)
    key = _routed("a ticket").template
    for i in range(PROBE_AFTER):
        decision = chosen.decide(_routed(f"ticket {i}"))
        assert (decision.pool, decision.rule) == ("standard", "time_saved")
        templates.seen(key)  # as the dispatcher counts what it admits
        templates.observe(key, "standard", seconds=1.0, tokens=100)
    templates.seen(key)
    for _ in range(MIN_MEASURED):
        decision = chosen.decide(_routed("ticket again"))
        assert (decision.pool, decision.rule) == ("dspark", "template_probe")
        templates.seen(key)
        templates.observe(key, "dspark", seconds=0.4, tokens=100)  # 2.5x: the pool learnt the template
    assert templates.speedup(key).speedup == pytest.approx(2.5)
    decision = chosen.decide(_routed("the next ticket"))
    assert (decision.pool, decision.rule) == ("dspark", "time_saved")
    assert decision.expected_speedup == pytest.approx(blended(COLD, templates.speedup(key)))
    assert "its template measured 2.50x over 2 DSpark answers" in decision.reason
    assert chosen.decide(_routed("the next ticket", tenant="acme")).pool == "standard"  # another scope is cold
    assert chosen.decide(_routed("no template here", system=None)).pool == "standard"


def test_a_template_dspark_answered_slowly_goes_back_to_the_standard_pool():
    templates = TemplateSpeeds("dspark", "standard")
    key = _routed("a ticket").template
    for _ in range(PROBE_AFTER + 1):
        templates.seen(key)
    for _ in range(MIN_MEASURED):
        templates.observe(key, "dspark", seconds=2.0, tokens=100)
    templates.observe(None, "standard", seconds=1.0, tokens=100)  # the pool's baseline, from any request
    assert templates.speedup(key).speedup == pytest.approx(0.5)
    assert not templates.probe(key)
    decision = _policy(templates).decide(_routed("another ticket"))
    assert (decision.pool, decision.rule) == ("standard", "time_saved")


def test_a_template_judged_for_the_standard_pool_is_measured_on_dspark_again_as_its_cache_grows():
    """DSpark's speed on a template grows with the answers its cache holds, and only its own answers fill it: a
    template its first answers judged slow there goes back to DSpark once every REPROBE_AFTER requests, and the new
    measurement, not the old verdict, decides what follows."""
    templates = TemplateSpeeds("dspark", "standard")
    chosen = _policy(templates)
    key = _routed("a ticket").template
    for _ in range(PROBE_AFTER + 1):
        templates.seen(key)
    for _ in range(MIN_MEASURED):
        templates.observe(key, "dspark", seconds=2.0, tokens=100)  # drafted from nothing: slow
    rules = []
    while "time_saved_dspark" not in rules and len(rules) < 100:
        decision = chosen.decide(_routed("another ticket"))
        rules.append(decision.rule + ("_dspark" if decision.pool == "dspark" and decision.rule == "time_saved" else ""))
        templates.seen(key)
        templates.observe(key, decision.pool, seconds=1.0 if decision.pool == "standard" else 0.4, tokens=100)
    probes = [i for i, rule in enumerate(rules) if rule == "template_probe"]
    assert rules[-1] == "time_saved_dspark" and len(probes) >= 2, rules
    assert all(REPROBE_AFTER < b - a <= REPROBE_AFTER + 2 for a, b in pairwise([-1, *probes]))  # seen, then answered


def test_templates_are_bounded_and_the_least_recently_seen_goes_first():
    templates = TemplateSpeeds("dspark", "standard")
    for i in range(MAX_TEMPLATES + 10):
        templates.seen(f"template-{i}")
        for _ in range(MIN_MEASURED):
            templates.observe(f"template-{i}", "dspark", seconds=1.0, tokens=10)
        templates.observe(f"template-{i}", "standard", seconds=2.0, tokens=10)
    assert templates.speedup("template-0") is None
    assert templates.speedup(f"template-{MAX_TEMPLATES + 9}").speedup == pytest.approx(2.0)


def test_the_router_counts_and_measures_a_template_and_probes_it_on_dspark(router_models, tmp_path):
    """Through a real router on the tiny models: a template's requests are counted as admitted, their answers timed
    per pool, and once it repeats, one goes to DSpark to be measured."""
    data = config_data(router_models, objective="time_saved", classifier="default")
    with make_router(tmp_path, data, scorer=GainScorer()) as router:
        body = {"messages": [SYSTEM, {"role": "user", "content": "the printer jams"}], "max_tokens": 4}
        body["metadata"] = {"gain": COLD}
        pools = [router.complete(**body).decision.pool for _ in range(PROBE_AFTER + MIN_MEASURED + 1)]
        assert pools[:PROBE_AFTER] == ["standard"] * PROBE_AFTER
        assert "dspark" in pools[PROBE_AFTER:]
        key = _routed("the printer jams").template
        assert router.policy.templates.speedup(key) is not None

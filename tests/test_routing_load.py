"""Load-aware routing (``policy.objective: time_saved``): a marginal subtask goes to DSpark while its pool is idle
and to the standard pool once DSpark's batch is full; a large gain survives load; decisions are deterministic;
pools report their load; bad settings are refused by key.

Loads are given as data (the estimator reads them through callables, as the router reads its pools), on a
synthetic cost curve: memory-bound (flat) up to 8 tokens a forward, compute-bound beyond.
"""

# ruff: noqa: F811 - the shared fixtures are imported by name and then requested as arguments

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import redis

from backends.scheduling import PROFILE_FILE, SpsCurve
from router.config import PolicyConfig, PoolConfig
from router.errors import ConfigError, RoutingError
from router.expected_time import LoadEstimator, PoolCost, PoolSide
from router.load import PoolLoad
from router.policy import Policy
from router.redis_jobs import PoolKeys, WorkerLoad
from router.redis_pool import RedisPool
from router.request import parse_openai_args
from tests.test_router_support import (  # noqa: F401
    MESSAGES,
    MetadataScorer,
    config_data,
    copy_model,
    make_router,
    router_models,
    saturated,
)

CURVE = SpsCurve({1: 100.0, 2: 100.0, 4: 100.0, 8: 100.0, 16: 50.0, 32: 25.0, 64: 12.5})
IDLE = PoolLoad(depth=0, running=0, workers=1, max_batch=16)
FULL = PoolLoad(depth=24, running=16, workers=1, max_batch=16)
BUSY = PoolLoad(depth=3, running=3, workers=1, max_batch=16)  # a newcomer makes a batch of 4: 16 tokens a forward
POOLS = frozenset({"dspark", "standard"})
MARGINAL, LARGE = 1.2, 3.0


class GainScorer:
    """A real scorer with an expected-gain model: the speedup a request carries in ``metadata.gain``."""

    predicts_speedup = True

    def score(self, request: dict[str, Any]) -> float:
        return 0.5

    def expected_speedup(self, request: dict[str, Any]) -> float:
        return float(request["metadata"]["gain"])


def policy(
    dspark: PoolLoad,
    standard: PoolLoad,
    *,
    seed: int = 0,
    explore: float = 0.0,
    standard_row_s: float = 0.0,
    **cost: Any,
) -> Policy:
    estimator = LoadEstimator(
        PoolSide("dspark", lambda: dspark, PoolCost(sps=CURVE, **cost)),
        PoolSide("standard", lambda: standard, PoolCost(sps=CURVE, row_s=standard_row_s)),
    )
    config = PolicyConfig(objective="time_saved", seed=seed, explore=explore)
    return Policy(config, GainScorer(), estimator)


def decide(chosen: Policy, gain: float, **args: Any):
    return chosen.decide(parse_openai_args({"messages": MESSAGES, "metadata": {"gain": gain}, **args}, POOLS))


def test_a_marginal_subtask_goes_to_dspark_while_it_is_idle_and_to_standard_when_it_is_saturated():
    idle = decide(policy(IDLE, IDLE), MARGINAL, max_tokens=64)
    assert (idle.pool, idle.rule, idle.expected_speedup) == ("dspark", "time_saved", MARGINAL)
    assert idle.load["dspark"].expected_s == pytest.approx(64 / (100 * MARGINAL))
    assert idle.load["standard"].expected_s == pytest.approx(64 / 100)
    assert idle.reason.startswith("expected 1.20x solo, 1.20x at dspark batch 1/16 vs standard batch 1/16")
    full = decide(policy(FULL, IDLE), MARGINAL)
    assert full.pool == "standard"
    assert full.load["dspark"].model_dump() | {"expected_s": None} == {
        "depth": 24,
        "running": 16,
        "workers": 1,
        "max_batch": 16,
        "batch": 16,
        "speedup": pytest.approx(MARGINAL * (12.5 / 50) / 1.0),  # 64-token forwards of a batch of 16
        "expected_s": None,
    }
    assert "dspark batch 16/16 +8 queued vs standard batch 1/16: standard saves" in full.reason


def test_under_load_only_the_subtasks_that_gain_most_go_to_dspark():
    busy = policy(BUSY, IDLE)
    assert decide(busy, MARGINAL).pool == "standard"  # 1.2x at 16 tokens a row-batch: 0.6x
    assert decide(busy, LARGE).pool == "dspark"  # 3x: still 1.5x
    # Both full, in compute-bound forwards: 4 tokens a row cost 4 times 1, more than even a 3x gain wins back.
    assert decide(policy(FULL, FULL), LARGE).pool == "standard"
    assert decide(policy(IDLE, IDLE), 0.9).pool == "standard"  # a loss on an idle pool is still a loss


def test_a_speedup_floor_and_a_fixed_verification_length_are_honoured():
    assert decide(policy(FULL, FULL, speedup_floor=1.1), MARGINAL).load["dspark"].speedup == 1.1
    # Verifying 2 tokens a row keeps a batch of 4 memory-bound: no toll.
    assert decide(policy(BUSY, IDLE, verify_tokens=2.0), MARGINAL).pool == "dspark"


def test_a_drafter_that_runs_once_per_request_makes_a_busy_dspark_pool_dearer():
    """On a flat curve verifying costs nothing, but a drafter pass per request (span heads: none) does: alone it
    is paid once a round, in a batch of 4 four times."""
    quick = PoolLoad(depth=3, running=3, workers=1, max_batch=16, solo_tokens_per_forward=2.0)
    drafting = PoolLoad(depth=3, running=3, workers=1, max_batch=16, solo_tokens_per_forward=2.0, draft_s=0.01)
    assert decide(policy(quick, IDLE), MARGINAL).load["dspark"].speedup == pytest.approx(MARGINAL)
    slowed = decide(policy(drafting, IDLE), MARGINAL)
    # round(1) = 10 ms + 10 ms, round(4) = 10 ms + 40 ms: the solo 1.2x keeps 20/50 of itself
    assert slowed.load["dspark"].speedup == pytest.approx(MARGINAL * 20 / 50) and slowed.pool == "standard"
    alone = PoolLoad(depth=0, running=0, workers=1, max_batch=16, solo_tokens_per_forward=2.0, draft_s=0.01)
    assert decide(policy(alone, IDLE), MARGINAL).pool == "dspark"


def test_what_each_row_adds_outside_the_curve_is_paid_on_both_sides():
    """``load.row_s``: a batched engine's per-row cost (sampling, bookkeeping) that a curve of one request never
    sees. On a DSpark pool it lengthens every round of a full batch, on a standard one every step."""
    busy = PoolLoad(depth=3, running=3, workers=1, max_batch=16, solo_tokens_per_forward=2.0)
    assert decide(policy(busy, IDLE), MARGINAL).pool == "dspark"  # a flat curve: 1.2x survives a batch of 4
    slowed = decide(policy(busy, IDLE, row_s=0.01), MARGINAL)
    # round(1) = 10 ms, round(4) = 10 ms + 3 rows x 10 ms: the solo 1.2x keeps a quarter of itself
    assert slowed.load["dspark"].speedup == pytest.approx(MARGINAL / 4) and slowed.pool == "standard"
    crowded = decide(policy(IDLE, FULL, standard_row_s=0.01), MARGINAL, max_tokens=64)
    # a step of 16 rows: 20 ms on the curve plus 15 rows x 10 ms; the queue of 8 waits half a batch more
    assert crowded.load["standard"].expected_s == pytest.approx(1.5 * 64 * (0.02 + 0.15))
    assert crowded.pool == "dspark"


def test_a_speedup_measured_where_verifying_is_cheap_shrinks_where_it_is_dear():
    """The classifier's speedups were measured on a machine whose verifying forward of 4 tokens cost one step
    (bfloat16, AMX); here (the test's curve made dear) it costs two: the same acceptance buys half the speedup."""
    dear = SpsCurve({1: 100.0, 2: 80.0, 4: 50.0, 8: 25.0})
    estimator = LoadEstimator(
        PoolSide("dspark", lambda: IDLE, PoolCost(sps=dear, verify_tokens=4.0)),
        PoolSide("standard", lambda: IDLE, PoolCost(sps=dear)),
    )
    here = estimator.choose(1.5, 64)
    assert here.pool == "dspark" and here.seen["dspark"].speedup == pytest.approx(1.5)
    carried = estimator.choose(1.5, 64, measured_on=CURVE)
    assert carried.pool == "standard" and carried.seen["dspark"].speedup == pytest.approx(0.75)

    class MeasuredElsewhere(GainScorer):
        calibration_curve = CURVE

    routed = parse_openai_args({"messages": MESSAGES, "metadata": {"gain": 1.5}}, POOLS)
    config = PolicyConfig(objective="time_saved")
    assert Policy(config, GainScorer(), estimator).decide(routed).pool == "dspark"
    assert Policy(config, MeasuredElsewhere(), estimator).decide(routed).pool == "standard"


def test_measured_solo_verification_length_is_used_when_none_is_configured():
    short = PoolLoad(depth=3, running=3, workers=1, max_batch=16, solo_tokens_per_forward=2.0)
    assert decide(policy(short, IDLE), MARGINAL).pool == "dspark"


def test_without_a_profile_the_estimate_is_depth_based():
    def unprofiled(dspark: PoolLoad, standard: PoolLoad) -> Policy:
        estimator = LoadEstimator(
            PoolSide("dspark", lambda: dspark, PoolCost()), PoolSide("standard", lambda: standard, PoolCost())
        )
        return Policy(PolicyConfig(objective="time_saved"), GainScorer(), estimator)

    assert decide(unprofiled(IDLE, IDLE), MARGINAL).pool == "dspark"
    deep = PoolLoad(depth=32, running=16, workers=1, max_batch=16)
    decision = decide(unprofiled(deep, IDLE), MARGINAL)
    assert decision.pool == "standard" and decision.load["dspark"].speedup == MARGINAL


def test_a_pool_without_live_workers_is_never_expected_to_answer():
    gone = PoolLoad(depth=2, running=0, workers=0, max_batch=16)
    decision = decide(policy(gone, FULL), LARGE)
    assert decision.pool == "standard" and decision.load["dspark"].expected_s is None
    assert "the other pool has no live worker" in decision.reason


def test_decisions_are_deterministic_for_a_seed():
    loads = [IDLE, BUSY, FULL, BUSY, IDLE] * 20

    def run(seed: int) -> list[tuple[str, bool]]:
        state = iter(loads)
        estimator = LoadEstimator(
            PoolSide("dspark", lambda: next(state), PoolCost(sps=CURVE)),
            PoolSide("standard", lambda: IDLE, PoolCost(sps=CURVE)),
        )
        chosen = Policy(PolicyConfig(objective="time_saved", seed=seed, explore=0.3), GainScorer(), estimator)
        return [(d.pool, d.explored) for d in (decide(chosen, 1.5) for _ in loads)]

    first = run(seed=3)
    assert run(seed=3) == first
    assert run(seed=4) != first
    assert {explored for _, explored in first} == {True, False}


def test_the_batch_a_request_would_join():
    assert IDLE.batch == 1 and BUSY.batch == 4 and FULL.batch == 16 and FULL.queued == 8
    assert PoolLoad(depth=5, running=5, workers=2, max_batch=16).batch == 3
    assert PoolLoad(depth=0, running=0, workers=0, max_batch=8).batch == 8


def test_a_noisy_profile_is_made_monotone():
    noisy = SpsCurve({1: 300.0, 2: 120.0, 4: 280.0, 8: 200.0, 16: 90.0})
    assert noisy.monotone().steps_per_s == {1: 300.0, 2: 280.0, 4: 280.0, 8: 200.0, 16: 90.0}


def test_time_saved_needs_an_expected_gain_model():
    with pytest.raises(ConfigError) as info:
        Policy(PolicyConfig(objective="time_saved"), MetadataScorer(), None)
    assert info.value.param == "policy.classifier"
    with pytest.raises(ConfigError) as info:
        Policy(PolicyConfig(objective="time_saved"), GainScorer(), None)
    assert info.value.param == "policy.objective"


class WildScorer(GainScorer):
    def expected_speedup(self, request: dict[str, Any]) -> float:
        return float("nan")


def test_a_speedup_that_is_not_a_positive_number_is_a_routing_error():
    chosen = Policy(PolicyConfig(objective="time_saved"), WildScorer(), policy(IDLE, IDLE).estimator)
    with pytest.raises(RoutingError, match="positive number"):
        decide(chosen, 1.0)


@pytest.mark.parametrize(
    ("policy_settings", "pool_load", "key"),
    [
        ({"objective": "fastest"}, {}, "policy.objective"),
        ({"objective": "time_saved", "classifier": None}, {}, "policy.objective"),
        ({}, {"speedup_floor": -1}, "pools.dspark.load.speedup_floor"),
        ({}, {"verify_tokens": 0.5}, "pools.dspark.load.verify_tokens"),
        ({}, {"tokens_per_s": 0}, "pools.dspark.load.tokens_per_s"),
        ({}, {"row_s": -0.1}, "pools.dspark.load.row_s"),
        ({}, {"budget": 3}, "pools.dspark.load.budget"),
    ],
)
def test_bad_load_settings_are_refused_by_key(tmp_path, router_models, policy_settings, pool_load, key):
    data = config_data(router_models, **policy_settings)
    data["pools"]["dspark"]["load"] = pool_load
    with pytest.raises(ConfigError) as info:
        make_router(tmp_path, data, scorer=GainScorer())
    assert info.value.param == key


def test_a_profile_file_that_holds_no_curve_is_refused_at_start(tmp_path, router_models):
    (tmp_path / "sps.json").write_text("[1, 2]")
    data = config_data(router_models, objective="time_saved", classifier="default")
    data["pools"]["dspark"]["load"] = {"profile": "sps.json"}
    with pytest.raises(ConfigError) as info:
        make_router(tmp_path, data, scorer=GainScorer())
    assert info.value.param == "pools.dspark.load.profile"


def test_the_router_reads_its_pools_load_when_it_decides(tmp_path, router_models):
    """The real in-process pools, one request at a time each: idle, DSpark gets the marginal subtask; held at
    capacity, the standard pool does. The cost curve is the models' own ``dspark_sps.json`` (``profile: auto``)."""
    models = {name: copy_model(path, tmp_path / name) for name, path in router_models.items()}
    for folder in models.values():
        (folder / PROFILE_FILE).write_text(json.dumps({"machine": {str(k): v for k, v in CURVE.steps_per_s.items()}}))
    data = config_data(models, objective="time_saved", classifier="default")
    router = make_router(tmp_path, data, scorer=GainScorer())
    try:
        assert router.policy.estimator.dspark.cost.sps == CURVE.monotone()
        idle = router.route(messages=MESSAGES, metadata={"gain": MARGINAL})
        assert (idle.pool, idle.rule) == ("dspark", "time_saved")
        assert idle.load["dspark"].depth == 0 and idle.load["dspark"].max_batch == 1
        with saturated(router, "dspark"):
            busy = router.route(messages=MESSAGES, metadata={"gain": MARGINAL})
        assert busy.pool == "standard" and busy.load["dspark"].depth == router.pools["dspark"].capacity
        result = router.complete(messages=MESSAGES, metadata={"gain": MARGINAL}, max_tokens=4, temperature=0)
        assert result.decision.rule == "time_saved" and result.decision.expected_speedup == MARGINAL
    finally:
        router.close()


def test_the_router_takes_this_machines_curve_from_the_drafters_folder(tmp_path, router_models):
    """A drafters' folder keeps one curve per machine; the router must weigh load on the machine it runs on (a
    float32 machine's verifying forwards cost far more than a bfloat16 one's), not on whichever was stored last,
    and find the file where the pool's drafters are, not in the target's folder."""
    from backends.dspark.curves import machine_key
    from backends.loading import resolve_device, resolve_precision

    models = {name: copy_model(path, tmp_path / name) for name, path in router_models.items()}
    drafters = tmp_path / "drafters"
    drafters.mkdir()
    device = resolve_device("cpu")
    here = machine_key(device, resolve_precision("auto", device, models["dspark"]))
    elsewhere = SpsCurve({1: 10.0, 4: 5.0, 16: 2.0})
    curves = {here: CURVE.steps_per_s, "cpu:elsewhere|torch.float32|threads=2": elsewhere.steps_per_s}
    (drafters / PROFILE_FILE).write_text(json.dumps({k: {str(n): v for n, v in c.items()} for k, c in curves.items()}))
    data = config_data(models, objective="time_saved", classifier="default")
    data["pools"]["dspark"]["drafter_path"] = str(drafters)
    data["pools"]["dspark"]["device"] = "cpu"
    pool = make_router(tmp_path, data, scorer=GainScorer())
    try:
        assert pool.policy.estimator.dspark.cost.sps == CURVE.monotone()
    finally:
        pool.close()


def test_in_process_pools_measure_what_a_lone_request_feeds_a_forward(tmp_path, router_models):
    router = make_router(tmp_path, config_data(router_models), scorer=None)
    try:
        assert router.pools["dspark"].load().solo_tokens_per_forward is None
        router.complete(messages=MESSAGES, max_tokens=12, temperature=0, model="dspark-router/dspark")
        router.complete(messages=MESSAGES, max_tokens=12, temperature=0, model="dspark-router/standard")
        assert router.pools["dspark"].load().solo_tokens_per_forward >= 1.0
        assert router.pools["standard"].load().solo_tokens_per_forward == pytest.approx(1.0)
        assert router.pools["standard"].load() == PoolLoad(0, 0, 1, 1, pytest.approx(1.0))
    finally:
        router.close()


def test_a_redis_pool_reports_the_load_its_workers_heartbeat(redis_url):
    config = PoolConfig(
        backend="autoregressive", model="remote", transport="redis", redis_url=redis_url, max_batch=8,
        redis={"prefix": f"load-{time.time_ns()}"},
    )  # fmt: skip
    pool = RedisPool("remote", config)
    assert pool.load() == PoolLoad(depth=0, running=0, workers=0, max_batch=8)
    client, keys = redis.Redis.from_url(redis_url), PoolKeys(config.redis.prefix, "remote")
    for worker, running in (("a", 3), ("b", 1)):
        client.zadd(keys.workers, {worker: time.time()})
        client.hset(keys.load, worker, WorkerLoad(running=running, concurrency=4).model_dump_json())
    client.xadd(keys.jobs, {"job": "{}"})
    time.sleep(0.3)  # past the cache of the workers' heartbeats
    assert pool.load() == PoolLoad(depth=1, running=4, workers=2, max_batch=4)


def test_the_embedded_default_carries_the_shipped_speedups_to_the_machine_it_routes_on():
    """The shipped classifier's speedups were measured on the packed engine on an Intel Xeon, where verifying 4
    tokens costs 1.39 steps; on the packed engine's AVX2 build on an AMD EPYC Zen 1 it costs 2.12. A greedy date
    rewrite it expects 1.31x from goes to DSpark on the first machine and to the standard pool on the second under
    the embedded default (``time_saved``), while the threshold objective, whose score no curve carries, decides the
    same on both."""
    from backends.default_model import DEFAULT_DRAFTERS
    from backends.dspark.curves import stored_curves
    from backends.scheduling import scaled_speedup
    from classifiers import load_default
    from router.config import load_config

    shipped = load_default()
    curves = {
        key: SpsCurve.from_stored(curve).monotone()
        for key, curve in stored_curves(DEFAULT_DRAFTERS / PROFILE_FILE).items()
    }
    measured_on = curves[shipped.info["calibration_profile"]["machine"]]
    zen1 = curves["cpu:AMD EPYC|gguf-avx2|threads=2"]
    rewrite = (
        "Rewrite every date in DD/MM/YYYY format.\n\nHiro Nguyen joined Initech as a engineer on 2023-01-18 with a "
        "salary of 33000 JPY. Flight AF343 from Vienna to Berlin leaves on 2023-01-18 at 19:00."
    )
    request = {"messages": [{"role": "user", "content": rewrite}], "temperature": 0}
    expected = shipped.expected_speedup(request)
    assert scaled_speedup(expected, measured_on, zen1) < 1.0 < expected  # the case the objective decides
    embedded = load_config(check_paths=False).policy
    assert embedded.objective == "time_saved"

    def routed(config: PolicyConfig, here: SpsCurve) -> str:
        estimator = LoadEstimator(
            PoolSide("dspark", lambda: IDLE, PoolCost(sps=here)), PoolSide("standard", lambda: IDLE, PoolCost(sps=here))
        )
        chosen = Policy(config.model_copy(update={"explore": 0.0}), shipped, estimator)
        return chosen.decide(parse_openai_args(request, POOLS)).pool

    assert routed(embedded, measured_on) == "dspark"
    assert routed(embedded, zen1) == "standard"
    by_score = embedded.model_copy(update={"objective": "threshold"})
    assert routed(by_score, measured_on) == routed(by_score, zen1)

"""``bench fleet``'s simulator: seeded, right on a queue with a known answer, and driven by the shipped policy."""

from __future__ import annotations

import numpy as np
import pytest

from backends.scheduling import SpsCurve
from benchmarks.fleet import WORKLOAD_REPORT, add_arguments, format_report, run_benchmark, settings_from
from benchmarks.fleet_policies import Fleet, Judged, Prescored, carried_speedups, classifier_scorers, simulate
from benchmarks.fleet_profiles import DEFAULT_PROFILE, CostProfile, load_profile
from benchmarks.fleet_trace import (
    AgentShape,
    Item,
    Items,
    calibration_items,
    kind_shares,
    replay_items,
    single_trace,
    synthetic_trace,
)
from classifiers import AGENT_MIX, DEFAULT_MEASUREMENTS, load_default
from router.config import load_config
from router.decisions import Decision, RouteRecord


@pytest.fixture(scope="module")
def classifier():
    return load_default()


@pytest.fixture(scope="module")
def items():
    return calibration_items(DEFAULT_MEASUREMENTS)


def _run(policy, items, classifier, profile_file, base, trace, load=0.7, workers=4, rules=True):
    """One simulation of ``policy`` on a small CPU fleet at ``load`` times the all-standard capacity."""
    profile = load_profile(DEFAULT_PROFILE)
    speedups = carried_speedups(items, profile)
    fleet = Fleet(profile, workers, 0.5, 1000)
    capacity = workers * profile.max_batch / profile.step_s(profile.max_batch, False) / trace.mean_tokens()
    arrivals = trace.arrivals(load * capacity * trace.runs / trace.subtasks)
    judged = Judged(base, rules, profile.sps_file(profile_file))
    return simulate(policy, judged, fleet, trace, arrivals, classifier_scorers(classifier, speedups), speedups)


def test_the_simulation_is_deterministic_for_a_seed(items, classifier, tmp_path):
    base = load_config(check_paths=False).policy
    runs = []
    for seed in (3, 3, 4):
        trace = synthetic_trace(items, kind_shares(AGENT_MIX), AgentShape(), 1500, seed)
        runs.append(_run("time_saved", items, classifier, tmp_path, base, trace))
    same, again, other = runs
    assert not np.isnan(same.done).any()
    np.testing.assert_array_equal(same.done, again.done)
    np.testing.assert_array_equal(same.pool, again.pool)
    assert same.rules == again.rules and same.explored == again.explored
    assert not np.array_equal(same.done, other.done)


def test_one_worker_of_fixed_service_time_waits_as_an_md1_queue(tmp_path):
    """Poisson arrivals at rate lambda to one worker of one row that serves each in S seconds: the mean wait in
    the queue is rho S / (2 (1 - rho)), rho = lambda S (the Pollaczek-Khinchine formula for M/D/1)."""
    service_s, rho = 0.5, 0.6
    profile = CostProfile("flat", "one row, 10 tokens a second", SpsCurve({1: 10.0}), 4.0, 0.0, 1, 0.0, 0.0)
    items = Items([Item("fixed", "fixed", {"messages": [{"role": "user", "content": "hi"}]}, 5.0, 1.0)], None)
    trace = synthetic_trace(items, {"fixed": 1.0}, AgentShape((1, 1), (1, 1)), 100_000, seed=1)
    judged = Judged(load_config(check_paths=False).policy, True, profile.sps_file(tmp_path))
    fleet = Fleet(profile, workers=1, dspark_share=0.5, max_queue=100_000)
    result = simulate("all_standard", judged, fleet, trace, trace.arrivals(rho / service_s), lambda *_: None, [1.0])
    wait = float(np.mean(result.done - result.sent)) - service_s
    assert wait == pytest.approx(rho * service_s / (2 * (1 - rho)), rel=0.05)


def test_the_policy_is_the_shipped_one_a_config_swap_changes_its_decisions(items, classifier, tmp_path):
    trace = synthetic_trace(items, kind_shares(AGENT_MIX), AgentShape(), 600, seed=0)
    shipped = load_config(check_paths=False)
    swapped_file = tmp_path / "router.yaml"
    swapped_file.write_text(
        "pools:\n"
        "  dspark: {backend: dspark, model: m}\n"
        "  standard: {backend: autoregressive, model: m}\n"
        "policy:\n"
        "  default_pool: standard\n"
        "  rules: [{name: everything-standard, pool: standard, match: {temperature: {max: 2}}}]\n"
    )
    swapped = load_config(swapped_file, check_paths=False)
    before = _run("time_saved", items, classifier, tmp_path, shipped.policy, trace)
    after = _run("time_saved", items, classifier, tmp_path, swapped.policy, trace)
    assert {"time_saved", "structured-output", "tool-arguments"} <= set(before.rules)
    assert (before.pool == 0).any()
    assert after.rules == {"everything-standard": trace.subtasks}
    assert (after.pool == 1).all()


def test_prescored_answers_are_the_classifiers_own(items, classifier):
    bodies = [item.body | {"metadata": {"item": i}} for i, item in enumerate(items.items[:20])]
    prescored = Prescored.of(classifier, bodies)
    for body in bodies:
        assert prescored.score(body) == pytest.approx(classifier.score(body), abs=1e-9)
        assert prescored.expected_speedup(body) == pytest.approx(classifier.expected_speedup(body), rel=1e-9)
    assert prescored.threshold == classifier.threshold


def test_a_decision_log_replays_its_measured_requests(tmp_path):
    decision = Decision(pool="dspark", policy_pool="dspark", rule="time_saved", reason="r")
    body = {"messages": [{"role": "user", "content": "Extract the date."}], "max_tokens": 32}
    usage = {"prompt_tokens": 5, "completion_tokens": 20, "total_tokens": 25}
    lines = [
        RouteRecord(ts=100.0 + i, request_id=f"r{i}", decision=decision, request=body, usage=usage, speedup=speedup)
        for i, speedup in enumerate((1.5, None, 0.9))
    ]
    log = tmp_path / "log.jsonl"
    log.write_text("".join(line.model_dump_json() + "\n" for line in lines))
    replayed, times, skipped = replay_items(log)
    assert [item.speedup for item in replayed.items] == [1.5, 0.9]
    np.testing.assert_allclose(times, [0.0, 2.0])
    assert skipped == {"no measured speedup (no shadow run)": 1}
    trace = single_trace(replayed, range(2), times, seed=0)
    assert trace.runs == trace.subtasks == 2


def test_bench_fleet_runs_end_to_end_and_reports(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    policies = "all_standard,time_saved,oracle"
    fleet = ["--workers", "4", "--subtasks", "400", "--loads", "0.5,1.2", "--policies", policies]
    args = parser.parse_args([*fleet, "--reality", str(WORKLOAD_REPORT)])
    report = run_benchmark(settings_from(args))
    assert set(report["results"]) == {"all_standard", "time_saved", "oracle"}
    assert report["comparison"]["by_load"]["1.2"]["past_saturation"]
    assert report["reality"]["rows"]
    text = format_report(report)
    assert max(len(line) for line in text.splitlines()) <= 80

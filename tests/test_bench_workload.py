"""``bench workload``: the seeded workload and arrivals, and a tiny end-to-end run on the tiny model with span
heads and a classifier trained on made-up speedups (the report's structure and invariants, no timing)."""

# ruff: noqa: F811 - the shared fixtures are imported by name and then requested as arguments

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import pytest

from backends.corpus.subtasks import KINDS
from benchmarks import workload
from benchmarks.workload_mix import arrivals, build_workload
from benchmarks.workload_policies import POLICIES, capacity, policy_config
from tests.test_bench_decode import write_prompts
from tests.test_classifier_model import classifier, records, saved  # noqa: F401
from tests.test_router_support import router_models  # noqa: F401


def many_prompts(folder: Path) -> Path:
    """Two sets of six prompts each."""
    folder.mkdir()
    for name in ("arith", "code"):
        rows = [{"id": f"{name}-{i}", "turns": [f"{name} question number {i}?"]} for i in range(6)]
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


def test_the_workload_is_seeded_and_in_its_stated_proportions(tmp_path):
    prompts = many_prompts(tmp_path / "prompts")
    first = build_workload(33, prompts, max_tokens=32)
    assert build_workload(33, prompts, max_tokens=32) == first
    assert sum(item.source == "prompt" for item in first) == 11
    assert {item.group for item in first if item.source == "subtask"} == set(KINDS)
    shares = Counter(item.group for item in first if item.source == "prompt")
    assert shares == {"arith": 6, "code": 5}  # round-robin over the sets
    assert [item.request["seed"] for item in first] == list(range(33))
    assert all(item.request["max_tokens"] <= 32 for item in first)
    assert {item.split for item in first if item.source == "subtask"} <= {"train", "val", "test"}
    assert all(item.source == "subtask" for item in build_workload(9, None, max_tokens=32))


def test_arrivals_are_seeded_by_seed_and_rate():
    schedule = arrivals(4.0, 50, items=10, seed=0)
    assert arrivals(4.0, 50, items=10, seed=0) == schedule
    assert arrivals(4.0, 50, items=10, seed=1) != schedule
    assert arrivals(8.0, 50, items=10, seed=0) != schedule
    times = [t for t, _ in schedule]
    assert times == sorted(times) and {i for _, i in schedule} <= set(range(10))
    assert 50 / 4.0 * 0.5 < times[-1] < 50 / 4.0 * 2  # Poisson at 4/s: about 12.5 s for 50 arrivals


def test_every_policy_gets_the_same_workers_slots_and_model():
    """The comparison is fair only at equal capacity: the routed policies split two workers between the pools,
    the single-pool ones give both to one pool."""
    model = Path("models/m")
    capacities = {name: capacity(policy_config(name, model, 16, None, seed=0)) for name in POLICIES}
    assert all(c == {"workers": 2, "slots": 32, "models": [str(model)]} for c in capacities.values()), capacities
    routed = policy_config("time_saved", model, 16, None, seed=0)["pools"]
    assert {name: pool["workers"] for name, pool in routed.items()} == {"dspark": 1, "standard": 1}


def test_bench_workload_end_to_end_on_a_tiny_model(router_models, saved, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    workload.add_arguments(parser)
    args = parser.parse_args(
        ["--model", str(router_models["dspark"]), "--prompts", str(write_prompts(tmp_path / "prompts")),
         "--classifier", str(saved), "--items", "6", "--requests", "3", "--rounds", "2", "--rates", "1,3",
         "--max-tokens", "8", "--max-batch", "2", "--json", str(tmp_path / "workload.json"),
         "--plots", str(tmp_path / "plots")]
    )  # fmt: skip
    assert workload.run(args) == 0
    report = json.loads((tmp_path / "workload.json").read_text())
    assert report["policies"] == list(POLICIES) and len(report["rates"]) == 2
    assert report["workload"]["requests"] == 6 and report["workload"]["prompts"] == 2
    assert report["notes"] == []  # the classifier file has its gain model
    assert {c["slots"] for c in report["capacity"].values()} == {4}
    for policy, runs in report["results"].items():
        for rate, run in runs.items():
            assert (run["completed"], run["errors"]) == (6, []), (policy, rate)
            assert run["greedy_mismatches"] == 0, (policy, rate)
            assert run["routing_p99_us"] > 0 and run["forward_passes_per_token"] > 0
    assert all(run["dspark_share"] == 0 for run in report["results"]["all_standard"].values())
    assert all(run["dspark_share"] == 1 for run in report["results"]["all_dspark"].values())
    assert set(report["dspark_share_by_occupancy"]) == set(POLICIES) - {"all_standard", "all_dspark"}
    assert set(report["comparison"]["by_rate"]) == set(report["rates"])
    assert set(report["comparison"]["targets_met"]) == {
        "beats_single_pools_every_rate",
        "oracle_saving_every_rate",
        "routing_p99_us",
    }
    assert {item["source"] for item in report["items"]} == {"subtask", "prompt"}
    for row in report["solo_routing"].values():  # routing never beats the oracle, nor the oracle either pool
        assert row["oracle_s"] <= min(row["routed_s"], row["standard_s"], row["dspark_s"]) + 1e-9
    assert sum(row["requests"] for row in report["solo_routing"].values()) == 6
    assert all(item["speedup"] > 0 and item["predicted"] > 0 for item in report["items"])
    for png in ("latency_vs_rate", "throughput_vs_speed", "speedup_by_group", "predicted_vs_measured"):
        assert (tmp_path / "plots" / f"{png}.png").stat().st_size > 1000
    assert (tmp_path / "plots" / "dspark_share.png").stat().st_size > 1000
    out = capsys.readouterr().out
    assert "time_saved" in out and "finished in" in out
    assert max(map(len, out.splitlines())) <= 80, out


def test_bad_settings_are_refused_by_name():
    parser = argparse.ArgumentParser()
    workload.add_arguments(parser)
    with pytest.raises(Exception, match="--rates"):
        workload.settings_from(parser.parse_args(["--rates", "1,0"]))

"""The simulator against the machine: ``bench workload``'s run, replayed through the simulator at its own scale.

``bench workload`` (``benchmarks/results/workload.json``) measured each of its requests alone on each pool, its
machine's cost curve, and the latency of every policy at a few arrival rates on two workers. Here the same
requests (each one's measured solo time as its length, its measured speedup as its truth, the expected-gain
model's prediction that ``time_saved`` saw) arrive on the same Poisson schedules (the same seeded
:func:`~benchmarks.workload_mix.arrivals`, each segment from an idle fleet, as there) at two simulated workers
with that curve (and the per-row costs ``bench batching`` measured on the same kind of machine, from the
default CPU profile); the simulated mean and p95 latency of each policy are set beside the measured ones.

The workload's classifier and time-saved policies ran without rules or exploration, and so do these. Its seed is
not in its report: the published run used the default, 0.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np

from backends.scheduling import DEFAULT_VERIFY_TOKENS, SpsCurve
from benchmarks.fleet_policies import Fleet, Judged, simulate
from benchmarks.fleet_profiles import DEFAULT_PROFILE, CostProfile, load_profile
from benchmarks.fleet_sim import SimResult
from benchmarks.fleet_trace import Item, Items, single_trace
from benchmarks.workload_mix import arrivals
from benchmarks.workload_policies import OracleScorer
from router.config import PolicyConfig

POLICIES = ("all_standard", "all_dspark", "time_saved", "oracle")
TARGET = 0.20
"""Simulated mean latency within 20% of the measured one."""
WORKLOAD_SEED = 0


def reality_check(path: Path) -> dict:
    data = json.loads(path.read_text(encoding="utf-8"))
    workload = data["workload"]
    same_machine = load_profile(DEFAULT_PROFILE)
    profile = CostProfile(
        name="bench-workload",
        description="the cost curve bench workload profiled on its machine",
        curve=SpsCurve.from_stored(data["profile_steps_per_s"]).monotone(),
        verify_tokens=DEFAULT_VERIFY_TOKENS,
        draft_s=0.0,
        max_batch=workload["max_batch"],
        standard_row_s=same_machine.standard_row_s,
        dspark_row_s=same_machine.dspark_row_s,
    )
    solo = data["items"]
    forwards_per_s = profile.curve.at(1)
    items = Items(
        [
            Item(
                name=entry["name"],
                kind=entry["group"],
                body={"messages": [{"role": "user", "content": entry["name"]}], "max_tokens": workload["max_tokens"]},
                tokens=entry["standard_s"] * forwards_per_s,
                speedup=entry["speedup"],
            )
            for entry in solo
        ],
        None,
    )
    scorers = {
        "time_saved": OracleScorer({i: entry["predicted"] for i, entry in enumerate(solo)}),
        "oracle": OracleScorer({i: entry["speedup"] for i, entry in enumerate(solo)}),
    }
    speedups = [entry["speedup"] for entry in solo]
    fleet = Fleet(profile, workers=2, dspark_share=0.5, max_queue=4096)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        judged = Judged(
            PolicyConfig(default_pool="standard", seed=WORKLOAD_SEED), False, profile.sps_file(Path(scratch))
        )
        for rate in data["rates"]:
            for policy in POLICIES:
                latencies = []
                for round_index in range(workload["rounds"]):
                    schedule = arrivals(
                        float(rate), workload["arrivals_per_segment"], len(solo), WORKLOAD_SEED, round_index
                    )
                    times, chosen = (np.array(column) for column in zip(*schedule))
                    trace = single_trace(items, chosen, times, round_index)
                    result = simulate(
                        policy, judged, fleet, trace, trace.arrivals(1.0), lambda p, _: scorers.get(p), speedups
                    )
                    latencies.append(_latencies(result))
                rows.append(_row(rate, policy, np.concatenate(latencies), data["results"][policy][rate]))
    return {
        "source": str(path),
        "workers": fleet.workers,
        "requests": len(solo),
        "rates": data["rates"],
        "policies": list(POLICIES),
        "rows": rows,
        "target": TARGET,
        "within_target": all(abs(row["mean_error"]) <= TARGET for row in rows),
        "worst_mean_error": max(abs(row["mean_error"]) for row in rows),
    }


def _latencies(result: SimResult) -> np.ndarray:
    return (result.done - result.sent)[~np.isnan(result.done)]


def _row(rate: str, policy: str, simulated: np.ndarray, measured: dict) -> dict:
    mean, p95 = float(simulated.mean()), float(np.percentile(simulated, 95))
    return {
        "rate": rate,
        "policy": policy,
        "measured_mean_s": measured["mean_latency_s"],
        "simulated_mean_s": mean,
        "mean_error": mean / measured["mean_latency_s"] - 1,
        "measured_p95_s": measured["p95_latency_s"],
        "simulated_p95_s": p95,
        "p95_error": p95 / measured["p95_latency_s"] - 1,
    }

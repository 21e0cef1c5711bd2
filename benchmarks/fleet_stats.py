"""What ``bench fleet`` reports of one simulation, and how the policies compare at each load against the issue's
targets.

Latency runs from the moment a subtask is sent (its run arrived, or the stage before it answered) to its answer,
so queueing counts; an agent run's latency from its arrival to its last answer. The first ``warmup`` share of
the runs, which find the fleet emptier than it stays, are left out of the latencies (not of the throughput).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from benchmarks.fleet_sim import SimResult

TARGETS = {"oracle_mean_ratio": 1.10}
"""``time_saved``'s mean latency at most 10% above the oracle's, at every load up to saturation."""
SINGLE = ("all_standard", "all_dspark")


def summarise(result: SimResult, runs_before: np.ndarray, warmup: float) -> dict:
    """``runs_before``: each subtask's run index; subtasks of the first ``warmup`` share of runs are left out of
    the latency figures."""
    first_run = int(len(result.run_sent) * warmup)
    kept = runs_before >= first_run
    answered = ~np.isnan(result.done)
    latency = (result.done - result.sent)[kept & answered]
    run_latency = (result.run_done - result.run_sent)[first_run:]
    run_latency = run_latency[~np.isnan(run_latency)]
    span = float(np.nanmax(result.done) - np.nanmin(result.sent)) if answered.any() else 0.0
    dspark = [index for index, on_dspark in enumerate(result.dspark) if on_dspark]
    p50, p95, p99 = (float(v) for v in np.percentile(latency, (50, 95, 99))) if len(latency) else (None,) * 3
    return {
        "subtasks": len(result.sent),
        "answered": int(answered.sum()),
        "refused": int((~answered).sum()),
        "spilled": result.spilled,
        "explored": result.explored,
        "span_s": span,
        "subtasks_per_s": float(answered.sum()) / span if span > 0 else 0.0,
        "mean_latency_s": float(latency.mean()) if len(latency) else None,
        "p50_latency_s": p50,
        "p95_latency_s": p95,
        "p99_latency_s": p99,
        "run_mean_latency_s": float(run_latency.mean()) if len(run_latency) else None,
        "run_p95_latency_s": float(np.percentile(run_latency, 95)) if len(run_latency) else None,
        "dspark_share": float(np.isin(result.pool[answered], dspark).mean()) if answered.any() else None,
        "rules": dict(result.rules.most_common()),
        "wall_s": result.wall_s,
    }


def compare(results: dict[str, dict[str, dict]], loads: Sequence[str], saturation: float = 1.0) -> dict:
    """Per load: the better single pool by mean latency; whether ``time_saved`` is at most its mean and p95 (up to
    saturation) or at most ``all_standard``'s (past it); each routed policy's mean over the oracle's; and the
    time each saves against ``all_standard`` (what routing to DSpark saves, as :mod:`classifiers.gain` counts it)
    as a share of the oracle's saving, where the oracle saves any."""
    by_load = {}
    for load in loads:
        at = {policy: runs[load] for policy, runs in results.items() if load in runs}
        singles = [policy for policy in SINGLE if policy in at]
        if "time_saved" not in at or not singles:
            continue
        best = min(singles, key=lambda policy: _mean(at[policy]))
        ours = at["time_saved"]
        past = float(load) > saturation
        reference = at.get("all_standard", at[best]) if past else at[best]
        entry = {
            "past_saturation": past,
            "better_single_pool": best,
            "meets_latency_target": all(
                _value(ours, key) <= _value(reference, key) for key in ("mean_latency_s", "p95_latency_s")
            ),
        }
        if "oracle" in at:
            oracle = _mean(at["oracle"])
            standard = _mean(at["all_standard"]) if "all_standard" in at else None
            for policy in ("threshold", "time_saved"):
                if policy in at:
                    entry[f"{policy}_over_oracle"] = _mean(at[policy]) / oracle
                    saved = None if standard is None or standard <= oracle else standard - oracle
                    entry[f"{policy}_oracle_share"] = None if saved is None else (standard - _mean(at[policy])) / saved
            if not past:
                entry["meets_oracle_target"] = entry["time_saved_over_oracle"] <= TARGETS["oracle_mean_ratio"]
        by_load[load] = entry
    met = by_load.values()
    return {
        "by_load": by_load,
        "targets_met": {
            "latency_every_load": bool(by_load) and all(entry["meets_latency_target"] for entry in met),
            "oracle_every_load_to_saturation": bool(by_load)
            and all(entry.get("meets_oracle_target", False) for entry in met if not entry["past_saturation"]),
        },
    }


def _mean(summary: dict) -> float:
    return _value(summary, "mean_latency_s")


def _value(summary: dict, key: str) -> float:
    value = summary.get(key)
    return float("inf") if value is None else value

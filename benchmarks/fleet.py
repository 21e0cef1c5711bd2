"""``dspark-router bench fleet``: the shipped routing policy judged on a simulated fleet far larger than this
machine, by a discrete-event simulation (:mod:`benchmarks.fleet_sim`).

1. A cost profile (:mod:`benchmarks.fleet_profiles`) says what a forward costs by batch and tokens per row: the
   project's measured CPU curve, or a GPU's from published figures (or measured on an H200).
2. A trace (:mod:`benchmarks.fleet_trace`): agent runs arriving as a Poisson process, each stages of parallel
   subtasks of the agent mix's kinds, every subtask a draw of a held-out calibration record (its speedup and its
   length); or a decision log replayed.
3. Each policy (:mod:`benchmarks.fleet_policies`: all-standard, all-DSpark, threshold, ``time_saved`` and an
   oracle) is the router's own ``Policy`` over the simulated pools' load, at every load of a sweep from light to
   past saturation, in units of the all-standard fleet's capacity.
4. The report: latency (mean, p95, p99) and throughput by load and policy, the share of the oracle's time saving
   each classified policy gets, the targets, and the simulator set against ``bench workload``'s measurements at
   that benchmark's own scale (:mod:`benchmarks.fleet_reality`).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from backends.errors import InvalidRequestError
from backends.precision import cpu_chip
from backends.progress import JobProgress
from benchmarks import fleet_plots
from benchmarks.fleet_policies import POLICIES, Fleet, Judged, carried_speedups, classifier_scorers, simulate
from benchmarks.fleet_profiles import DEFAULT_PROFILE, CostProfile, bundled, load_profile
from benchmarks.fleet_reality import reality_check
from benchmarks.fleet_stats import compare, summarise
from benchmarks.fleet_trace import (
    HELD_OUT,
    AgentShape,
    Trace,
    calibration_items,
    kind_shares,
    replay_items,
    single_trace,
    synthetic_trace,
)
from benchmarks.output import wrapped, write_json, write_plots
from classifiers import AGENT_MIX, DEFAULT_CLASSIFIER, DEFAULT_MEASUREMENTS
from router.config import PolicyConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD_REPORT = ROOT / "benchmarks" / "results" / "workload.json"
LOADS = (0.2, 0.4, 0.6, 0.8, 0.9, 1.0, 1.1, 1.25)
QUICK = {"workers": 20, "subtasks": 20_000, "loads": (0.5, 0.9, 1.2)}
# What decides whether a load's latencies are its steady state is the simulated time, not the fleet's size: 100
# workers take 200,000 subtasks over ~10 minutes at full load (a subtask takes seconds), 1,000 workers over one,
# and give the same latencies as 1,000 workers over 2,000,000 subtasks (within 1%, at 0.9). The simulator does
# 1,000 workers and 1,000,000 subtasks in about 25 s (--workers 1000 --subtasks 1000000 --loads 0.9).
FULL = {"workers": 100, "subtasks": 200_000, "loads": LOADS}
WARMUP = 0.1


@dataclass(frozen=True)
class Settings:
    profile: str
    workers: int
    dspark_share: float
    max_queue: int
    subtasks: int
    loads: tuple[float, ...]
    """Offered subtasks per second as multiples of the all-standard fleet's capacity."""
    policies: tuple[str, ...]
    config: Path | None
    with_rules: bool
    classifier: Path
    records: Path
    splits: tuple[str, ...]
    mix: Path
    shape: AgentShape
    replay: Path | None
    reality: Path | None
    seed: int


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default=DEFAULT_PROFILE, help=f"a profile file or one of: {', '.join(bundled())}")
    p.add_argument("--workers", type=int, help=f"workers in all (default {FULL['workers']}, quick {QUICK['workers']})")
    p.add_argument("--dspark-share", type=float, default=0.5, help="routed policies: share of workers on DSpark")
    p.add_argument("--max-queue", type=int, default=100_000, help="requests a pool queues beyond its batches")
    p.add_argument(
        "--subtasks", type=int, help=f"subtasks per policy and load (default {FULL['subtasks']:,}; a replay: its own)"
    )
    p.add_argument("--loads", help="offered load as multiples of the all-standard fleet's capacity, comma-separated")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated, of: " + ", ".join(POLICIES))
    p.add_argument("--config", type=Path, help="router YAML whose policy is judged (default: the embedded one)")
    p.add_argument("--without-rules", action="store_true", help="judge the policy without its rules")
    p.add_argument("--classifier", type=Path, default=DEFAULT_CLASSIFIER, help="classifier with its gain model")
    p.add_argument("--records", type=Path, default=DEFAULT_MEASUREMENTS, help="measured records to draw from")
    p.add_argument("--splits", default=",".join(HELD_OUT), help="the records' splits to draw from")
    p.add_argument("--mix", type=Path, default=AGENT_MIX, help="JSONL whose 'kind' shares are the subtask mix")
    p.add_argument("--stages", default="1-3", help="stages per agent run, a range")
    p.add_argument("--fanout", default="1-6", help="parallel subtasks per stage, a range")
    p.add_argument("--replay", type=Path, help="replay a decision log (log.jsonl) instead of agent runs")
    p.add_argument(
        "--reality", type=Path, default=WORKLOAD_REPORT, help="bench workload's JSON to check against ('none': skip)"
    )
    p.add_argument("--seed", type=int, default=0, help="the trace")
    p.add_argument("--quick", action="store_true", help="20 workers, 20,000 subtasks, 3 loads")
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--plots", type=Path, help="folder for the PNG plots")


def _range(text: str, name: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    try:
        bounds = (int(low), int(high or low))
    except ValueError:
        raise InvalidRequestError(f"--{name} must be N or N-M, not {text!r}", param=name) from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise InvalidRequestError(f"--{name} must be 1 <= N <= M, not {text!r}", param=name)
    return bounds


def settings_from(args: argparse.Namespace) -> Settings:
    preset = QUICK if args.quick else FULL
    policies = tuple(args.policies.split(","))
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown:
        raise InvalidRequestError(f"unknown policies: {', '.join(unknown)}", param="policies")
    settings = Settings(
        profile=args.profile,
        workers=args.workers or preset["workers"],
        dspark_share=args.dspark_share,
        max_queue=args.max_queue,
        subtasks=args.subtasks or preset["subtasks"],
        loads=tuple(float(x) for x in args.loads.split(",")) if args.loads else preset["loads"],
        policies=policies,
        config=args.config,
        with_rules=not args.without_rules,
        classifier=args.classifier,
        records=args.records,
        splits=tuple(args.splits.split(",")),
        mix=args.mix,
        shape=AgentShape(_range(args.stages, "stages"), _range(args.fanout, "fanout")),
        replay=args.replay,
        reality=None if str(args.reality) == "none" else args.reality,
        seed=args.seed,
    )
    if settings.workers < 2 or settings.subtasks < 1 or min(settings.loads) <= 0:
        raise InvalidRequestError("--workers must be >= 2, --subtasks and --loads > 0", param="workers")
    if not 0 < settings.dspark_share < 1:
        raise InvalidRequestError("--dspark-share must be between 0 and 1", param="dspark_share")
    return settings


def build_trace(settings: Settings) -> tuple[Trace, dict]:
    """The synthetic agent trace, or the replayed log; and what the report says of it."""
    if settings.replay is not None:
        items, times, skipped = replay_items(settings.replay)
        trace = single_trace(items, range(len(items.items)), times, settings.seed)
        return trace, {"kind": "replay", "log": str(settings.replay), "skipped": skipped}
    items = calibration_items(settings.records, settings.splits)
    shares = kind_shares(settings.mix)
    trace = synthetic_trace(items, shares, settings.shape, settings.subtasks, settings.seed)
    shape = {"stages": list(settings.shape.stages), "fanout": list(settings.shape.fanout)}
    described = {"kind": "agent runs", "records": str(settings.records), "splits": list(settings.splits)}
    return trace, described | {"kind_shares": shares, "shape": shape}


def capacity(profile: CostProfile, workers: int, trace: Trace) -> float:
    """Subtasks per second the all-standard fleet finishes with every batch full: the unit of load."""
    return workers * profile.max_batch / profile.step_s(profile.max_batch, False) / trace.mean_tokens()


def run_sweep(
    settings: Settings, base: PolicyConfig, fleet: Fleet, trace: Trace, scale_of: Callable[[float], float]
) -> dict[str, dict[str, dict]]:
    """Every policy at every load, each a fresh fleet; the summaries by policy and load."""
    from classifiers.model import DeterminismClassifier

    classifier = DeterminismClassifier.load(settings.classifier)
    if not classifier.predicts_speedup:
        raise InvalidRequestError(
            f"{settings.classifier} has no expected-gain model (run calibrate)", param="classifier"
        )
    speedups = carried_speedups(trace.items, fleet.profile)
    scorers = classifier_scorers(classifier, speedups)
    runs = trace.subtask_run()
    results: dict[str, dict[str, dict]] = {policy: {} for policy in settings.policies}
    with tempfile.TemporaryDirectory() as scratch, JobProgress(log_every=len(settings.policies)) as progress:
        judged = Judged(base, settings.with_rules, fleet.profile.sps_file(Path(scratch)))
        job = progress.add_job("fleet", total=len(settings.loads) * len(settings.policies))
        for load in settings.loads:
            arrivals = trace.arrivals(scale_of(load))
            for policy in settings.policies:

                def answered(count: int, where: str = f"x{load:g} {policy}") -> None:
                    progress.update(job, status=f"{where}: {count:,}/{trace.subtasks:,}")

                result = simulate(policy, judged, fleet, trace, arrivals, scorers, speedups, answered)
                results[policy][f"{load:g}"] = summarise(result, runs, WARMUP)
                progress.step(job, status=f"x{load:g} {policy}: {result.wall_s:.1f} s")
    return results


def run_benchmark(settings: Settings) -> dict:
    profile = load_profile(settings.profile)
    trace, described = build_trace(settings)
    unit = capacity(profile, settings.workers, trace)
    per_run = trace.subtasks / trace.runs
    pace = trace.subtasks / float(trace.unit_times[-1]) if trace.runs > 1 else 1.0

    def scale_of(load: float) -> float:
        """How much faster than its unit pace the trace arrives at this load."""
        return load * unit / pace

    fleet = Fleet(profile, settings.workers, settings.dspark_share, settings.max_queue)
    base = load_config(settings.config, check_paths=False).policy
    started = time.perf_counter()
    results = run_sweep(settings, base, fleet, trace, scale_of)
    sweep_s = time.perf_counter() - started
    keys = [f"{load:g}" for load in settings.loads]
    simulated = len(settings.loads) * len(settings.policies) * trace.subtasks
    return {
        "machine": {"cpu": cpu_chip(), "cpus": os.cpu_count(), "cores_used": 1},
        "profile": {
            "name": profile.name,
            "description": profile.description,
            "max_batch": profile.max_batch,
            "verify_tokens": profile.verify_tokens,
            "draft_s": profile.draft_s,
            "standard_row_s": profile.standard_row_s,
            "dspark_row_s": profile.dspark_row_s,
            "steps_per_s": {str(n): rate for n, rate in profile.curve.steps_per_s.items()},
        },
        "fleet": {
            "workers": settings.workers,
            "routed": {
                spec.name: spec.workers for spec in fleet.specs("time_saved", base.dspark_pool, base.standard_pool)
            },
            "max_queue": settings.max_queue,
        },
        "trace": described
        | {
            "subtasks": trace.subtasks,
            "runs": trace.runs,
            "subtasks_per_run": per_run,
            "mean_tokens": trace.mean_tokens(),
            "items": len(trace.items.items),
            "seed": settings.seed,
        },
        "judged": {"config": str(settings.config or "the embedded default"), "rules": settings.with_rules},
        "capacity_subtasks_per_s": unit,
        "loads": keys,
        "offered_subtasks_per_s": {key: load * unit for key, load in zip(keys, settings.loads)},
        "policies": list(settings.policies),
        "warmup": WARMUP,
        "results": results,
        "comparison": compare(results, keys),
        "reality": reality_check(settings.reality) if settings.reality is not None else None,
        "timing": {
            "simulations": len(settings.loads) * len(settings.policies),
            "subtasks": simulated,
            "wall_s": sweep_s,
            "us_per_subtask": sweep_s / simulated * 1e6,
        },
    }


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _share(value: float | None) -> str:
    """A share of the oracle's saving: far below zero where the oracle saves little, so clipped to fit."""
    if value is None:
        return "-"
    return "<-999%" if value < -9.99 else f"{value:.0%}"


def format_report(report: dict) -> str:
    """The latency table (a row per load and policy), the targets, the reality check and the timing: 80 columns."""
    fleet, trace, profile = report["fleet"], report["trace"], report["profile"]
    routed = " + ".join(f"{count} {name}" for name, count in fleet["routed"].items())
    judged = report["judged"]
    lines = [
        f"bench fleet: {fleet['workers']:,} workers of {profile['name']} (batch {profile['max_batch']}), "
        f"routed policies on {routed}; {trace['subtasks']:,} subtasks in {trace['runs']:,} {trace['kind']} per "
        f"policy and load; judged: {judged['config']}, {'with' if judged['rules'] else 'without'} its rules",
        f"load: offered subtasks/s over the all-standard fleet's capacity "
        f"({report['capacity_subtasks_per_s']:,.0f}/s); latency in seconds, the first {report['warmup']:.0%} of "
        "runs left out; 'oracle': the time saved over all-standard as a share of the oracle's saving",
        "",
        f"{'load':>5} {'policy':<12} {'sub/s':>7} {'mean':>6} {'p95':>6} {'p99':>6} {'run':>6} {'dspark':>6} "
        f"{'oracle':>6}",
    ]
    comparison = report["comparison"]["by_load"]
    for load in report["loads"]:
        for policy in report["policies"]:
            r = report["results"][policy][load]
            share = comparison.get(load, {}).get(f"{policy}_oracle_share")
            lines.append(
                f"{load:>5} {policy:<12} {r['subtasks_per_s']:>7,.0f} {_cell(r['mean_latency_s'], '>6.2f')} "
                f"{_cell(r['p95_latency_s'], '>6.2f')} {_cell(r['p99_latency_s'], '>6.2f')} "
                f"{_cell(r['run_mean_latency_s'], '>6.2f')} {_cell(r['dspark_share'], '>6.0%')} "
                f"{_share(share):>6}"
            )
    lines.append("")
    for load, entry in comparison.items():
        versus = "all_standard" if entry["past_saturation"] else entry["better_single_pool"]
        ratio = entry.get("time_saved_over_oracle")
        lines.append(
            f"x{load}: time_saved {'at most' if entry['meets_latency_target'] else 'NOT at most'} {versus}'s "
            "mean and p95"
            + (f"; {ratio:.2f}x the oracle's mean" if ratio is not None else "")
            + (" (past saturation)" if entry["past_saturation"] else "")
        )
    lines += _reality_lines(report.get("reality"))
    timing = report["timing"]
    lines += [
        "",
        f"simulated {timing['simulations']} runs, {timing['subtasks']:,} subtasks in {timing['wall_s']:.0f} s on one "
        f"core of {report['machine']['cpu']}: {timing['us_per_subtask']:.0f} µs a subtask",
    ]
    return "\n".join(wrapped(line) for line in lines)


def _reality_lines(reality: dict | None) -> list[str]:
    if reality is None:
        return []
    lines = [
        "",
        f"reality check: bench workload's {reality['requests']} requests and schedules on its "
        f"{reality['workers']} workers, measured there and simulated here (target: mean within "
        f"{reality['target']:.0%})",
        f"{'rate/s':>6} {'policy':<12} {'mean':>6} {'sim':>6} {'error':>6} {'p95':>6} {'sim':>6} {'error':>6}",
    ]
    for row in reality["rows"]:
        lines.append(
            f"{row['rate']:>6} {row['policy']:<12} {row['measured_mean_s']:>6.2f} {row['simulated_mean_s']:>6.2f} "
            f"{row['mean_error']:>+6.0%} {row['measured_p95_s']:>6.2f} {row['simulated_p95_s']:>6.2f} "
            f"{row['p95_error']:>+6.0%}"
        )
    verdict = "within" if reality["within_target"] else "NOT within"
    lines.append(f"simulated means {verdict} {reality['target']:.0%} (worst {reality['worst_mean_error']:.0%})")
    return lines


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    started = time.perf_counter()
    report = run_benchmark(settings)
    report["elapsed_s"] = round(time.perf_counter() - started, 1)
    print(format_report(report))
    print(f"finished in {report['elapsed_s']:.0f} s")
    write_json(args.json, report)
    write_plots(args.plots, report, fleet_plots.draw_all)
    return 0

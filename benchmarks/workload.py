"""``dspark-router bench workload``: an agent's mixed workload arriving open loop at rates from light to
saturating, through a real router under each policy at equal capacity, interleaved in one run.

1. The workload (:mod:`benchmarks.workload_mix`) is measured solo first: every request once on DSpark (exact)
   and once on plain decoding, on one model, greedy or with its own seed. That gives each request's measured
   speedup (what the oracle knows), the reference outputs of the greedy check, and the capacity of one worker
   serving one request at a time, in requests per second, which the arrival rates are multiples of.
2. The target's steps per second by forward length is profiled here (one thread, in memory, never written
   beside the model) and given to every pool as ``load.profile``, so ``time_saved`` weighs load on this
   machine's cost curve.
3. Per rate, in each of a few rounds, every policy (:mod:`benchmarks.workload_policies`) in turn, in an order
   rotated from round to round, gets the round's Poisson arrivals of the same requests; a segment ends when its
   last request is answered. Several short rounds rather than one long segment per policy, so that a spell of
   machine noise hits every policy alike; each policy's numbers pool its rounds.

The expected-gain model is the classifier file's; a file from before it existed is retrained in memory from
calibrate's measurements (the classifier's own corpus, never the real prompts), and the report says so.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from backends.default_model import DEFAULT_MODEL
from backends.errors import InvalidRequestError
from backends.progress import JobProgress
from backends.scheduling import SpsCurve, scaled_speedup
from backends.types import GenerationRequest
from benchmarks import workload_plots
from benchmarks.output import wrapped, write_json, write_plots
from benchmarks.workload_mix import SUBTASK_SHARE, WorkItem, arrivals, build_workload
from benchmarks.workload_policies import POLICIES, OracleScorer, build_router, capacity, policy_config
from benchmarks.workload_stats import Outcome, compare, summarise
from classifiers import DEFAULT_CLASSIFIER, DEFAULT_MEASUREMENTS
from router import Router

if TYPE_CHECKING:
    from backends.local import LocalBackend
    from classifiers.model import DeterminismClassifier

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_PROMPTS = ROOT.parent / "shared" / "data" / "prompts"
# Sized for a 135M target on 2 cores (a request takes 2-4 s alone): 24 minutes in all on an EPYC in float32, 5 of
# them measuring every request solo. Half-loaded, saturated and overloaded: 1x one worker's capacity is half of two
# workers'. Two rounds, since one round of 12 arrivals left differences of 0.1-0.5 s within the noise.
QUICK = {"items": 18, "requests": 8, "rounds": 1, "rates": (1.0, 4.0), "max_tokens": 32}
FULL = {"items": 36, "requests": 12, "rounds": 2, "rates": (1.0, 2.0, 4.0), "max_tokens": 48}
PROFILE_REPEATS = 9
WARMUP = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0.0}


@dataclass(frozen=True)
class Settings:
    model: Path
    prompts: Path | None
    classifier: Path
    measurements: Path
    items: int
    requests: int
    """Arrivals per policy, rate and round."""
    rounds: int
    rates: tuple[float, ...]
    """Arrival rates as multiples of one worker's capacity (one request at a time)."""
    max_tokens: int
    max_batch: int
    threshold: float | None
    seed: int


@dataclass(frozen=True)
class Solo:
    """One workload request measured alone on each pool."""

    item: WorkItem
    speedup: float
    predicted: float
    standard_s: float
    reference: list[int] | None
    """The standard pool's greedy output tokens; None for sampled requests."""


@dataclass(frozen=True)
class RunData:
    """What one run measured, for :func:`report`."""

    solo: list[Solo]
    capacity: float
    rates: list[float]
    results: dict[str, dict[str, dict]]
    """policy -> rate -> :func:`~benchmarks.workload_stats.summarise`'s numbers."""
    shares: dict[str, list[tuple[float | None, bool]]]
    """policy -> (DSpark pool occupancy at arrival, sent to DSpark) per request."""
    curve: SpsCurve
    threshold: float
    notes: list[str]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="the model both pools serve")
    p.add_argument(
        "--prompts", type=Path, default=DEFAULT_PROMPTS, help="real prompts folder (evaluation only; 'none': skip)"
    )
    p.add_argument("--classifier", type=Path, default=DEFAULT_CLASSIFIER, help="classifier with its gain model")
    p.add_argument(
        "--measurements", type=Path, default=DEFAULT_MEASUREMENTS, help="to retrain a file without a gain model"
    )
    p.add_argument("--items", type=int, help=f"workload requests (default {FULL['items']}, quick {QUICK['items']})")
    p.add_argument("--requests", type=int, help=f"arrivals per policy, rate and round (default {FULL['requests']})")
    p.add_argument("--rounds", type=int, help=f"rounds of every policy per rate (default {FULL['rounds']})")
    p.add_argument("--rates", help="arrival rates as multiples of one worker's capacity, comma-separated")
    p.add_argument("--max-tokens", type=int, help=f"cap on each request (default {FULL['max_tokens']})")
    p.add_argument("--max-batch", type=int, default=16, help="requests a worker decodes at once")
    p.add_argument("--threshold", type=float, help="the classifier policy's threshold (default: its calibrated one)")
    p.add_argument("--seed", type=int, default=0, help="arrivals and the random policy")
    p.add_argument("--quick", action="store_true", help="fewer requests and rates (about a third of the time)")
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--plots", type=Path, help="folder for the PNG plots")


def settings_from(args: argparse.Namespace) -> Settings:
    preset = QUICK if args.quick else FULL
    rates = tuple(float(r) for r in args.rates.split(",")) if args.rates else preset["rates"]
    settings = Settings(
        model=args.model,
        prompts=None if str(args.prompts) == "none" else args.prompts,
        classifier=args.classifier,
        measurements=args.measurements,
        items=args.items or preset["items"],
        requests=args.requests or preset["requests"],
        rounds=args.rounds or preset["rounds"],
        rates=rates,
        max_tokens=args.max_tokens or preset["max_tokens"],
        max_batch=args.max_batch,
        threshold=args.threshold,
        seed=args.seed,
    )
    counts = (settings.items, settings.requests, settings.rounds, settings.max_tokens, settings.max_batch)
    if min(counts) < 1 or min(rates) <= 0:
        raise InvalidRequestError(
            "--items, --requests, --rounds, --max-tokens, --max-batch and --rates must be > 0", param="rates"
        )
    return settings


def gain_classifier(settings: Settings) -> tuple[DeterminismClassifier, list[str]]:
    """The classifier with an expected-gain model: the file's, or retrained in memory from the measurements."""
    from classifiers.model import DeterminismClassifier
    from classifiers.records import read_measurements
    from classifiers.train import train

    classifier = DeterminismClassifier.load(settings.classifier)
    if classifier.predicts_speedup:
        return classifier, []
    records, _ = read_measurements(settings.measurements)
    note = (
        f"{settings.classifier.name} has no expected-gain model: classifier and gain model retrained in memory "
        f"from {settings.measurements.name} ({len(records)} calibration records)"
    )
    return train(records, classifier.margin), [note]


def measure_solo(
    items: list[WorkItem], classifier: DeterminismClassifier, pools: dict[str, LocalBackend], curve: SpsCurve
) -> tuple[list[Solo], list[str]]:
    """Every request once per pool, in blocks as calibration measures (``classifiers.calibrate.in_blocks``);
    those that do not fit the model's context are left out. The predicted speedup is the expected-gain model's
    carried over from its calibration machine to this one's ``curve``, as the ``time_saved`` policy carries it."""
    from classifiers.calibrate import in_blocks, speedup_of

    calibrated = classifier.calibration_curve
    carried = 1.0 if calibrated is None else scaled_speedup(1.0, calibrated.monotone(), curve)
    measured, skipped = [], []
    requests = [GenerationRequest(**item.request) for item in items]
    with JobProgress(log_every=10) as progress:
        job = progress.add_job("measure solo", total=len(items))
        for item, runs in zip(items, in_blocks(pools, requests, 1, 1), strict=True):
            if isinstance(runs, InvalidRequestError):
                skipped.append(item.name)
                progress.step(job, status=f"skipped {item.name}")
                continue
            standard = runs["standard"][0]
            measured.append(
                Solo(
                    item=item,
                    speedup=speedup_of(runs),
                    predicted=classifier.expected_speedup(item.request) * carried,
                    standard_s=standard.stats.wall_time_s,
                    reference=standard.token_ids if item.greedy else None,
                )
            )
            progress.step(job, status=f"{item.name}: {measured[-1].speedup:.2f}x")
    notes = [f"left out (prompt plus max_tokens beyond the context): {', '.join(skipped)}"] if skipped else []
    return measured, notes


def write_profile(pools: dict[str, LocalBackend], max_tokens: int, folder: Path) -> tuple[Path, SpsCurve]:
    """This machine's curve, in ``dspark_sps.json``'s layout, in a scratch folder; and the curve the router
    makes of it (monotone), for the report."""
    from backends.dspark.profile import measure_sps

    curve = measure_sps(pools["standard"].loaded, max_tokens, repeats=PROFILE_REPEATS)
    path = folder / "dspark_sps.json"
    path.write_text(json.dumps({"bench": {str(k): v for k, v in curve.steps_per_s.items()}}))
    return path, curve.monotone()


def time_decisions(router: Router) -> list[tuple[float, float]]:
    """Wrap the router's policy so each decision's wall and CPU time (µs) is recorded, and nothing else."""
    timings: list[tuple[float, float]] = []
    decide = router.policy.decide

    def timed(routed):
        wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
        decision = decide(routed)
        timings.append(((time.perf_counter_ns() - wall) / 1e3, (time.thread_time_ns() - cpu) / 1e3))
        return decision

    router.policy.decide = timed
    return timings


def warm_up(router: Router) -> None:
    """Load every replica and decode once on each, so no segment pays for a first request."""
    router.warmup()
    for name, pool in router.config.pools.items():
        router.map([{**WARMUP, "model": f"dspark-router/{name}"}] * pool.workers, concurrency=pool.workers)


def run_segment(router: Router, solo: list[Solo], schedule: list[tuple[float, int]]) -> tuple[list[Outcome], float]:
    """Send each request at its arrival time, whatever is still running; return when all are answered."""
    dspark = router.pools.get("dspark") if "standard" in router.pools else None
    finished: list[float] = []
    lock = threading.Lock()
    start = time.perf_counter()

    def one(index: int, due: float) -> Outcome:
        measured, arrived = solo[index], start + due
        occupancy = None
        if dspark is not None:
            load = dspark.load()
            occupancy = load.depth / load.slots
        try:
            result = router.complete(**measured.item.request, metadata={"item": measured.item.name})
        except Exception as exc:  # counted and reported: a policy that fails requests must not look fast
            return Outcome(index, None, error=f"{type(exc).__name__}: {exc}"[:160])
        done = time.perf_counter()
        with lock:
            finished.append(done)
        sent_lag = done - arrived - result.measured.latency_s
        return Outcome(
            item=index,
            latency_s=done - arrived,
            ttft_s=result.measured.ttft_s + sent_lag,
            tokens=result.usage.completion_tokens,
            forward_passes=result.stats.forward_passes,
            pool=result.decision.pool,
            mismatch=None if measured.reference is None else result.token_ids != measured.reference,
            dspark_occupancy=occupancy,
        )

    with ThreadPoolExecutor(max_workers=len(schedule), thread_name_prefix="client") as clients:
        futures = []
        for due, index in schedule:
            pause = start + due - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
            futures.append(clients.submit(one, index, due))
        outcomes = [future.result() for future in futures]
    span = (max(finished) if finished else time.perf_counter()) - (start + schedule[0][0])
    return outcomes, span


Pooled = tuple[list[Outcome], list[tuple[float, float]], float]
"""A policy's requests at one rate over all rounds, its decisions' timings, and the rounds' summed span."""


def run_rate(
    routers: dict[str, Router],
    timings: dict[str, list[tuple[float, float]]],
    solo: list[Solo],
    rate: float,
    settings: Settings,
    turn: int,
    step: Callable[[str], None],
) -> dict[str, Pooled]:
    """Every round of one rate: each round's arrivals go to every policy in turn, the order rotated by one from
    round to round (``turn`` counts the rounds run before), so no policy always runs first or last."""
    pooled: dict[str, Pooled] = {policy: ([], [], 0.0) for policy in POLICIES}
    for round_index in range(settings.rounds):
        schedule = arrivals(rate, settings.requests, len(solo), settings.seed, round_index)
        shift = (turn + round_index) % len(POLICIES)
        for policy in POLICIES[shift:] + POLICIES[:shift]:
            first = len(timings[policy])
            outcomes, span = run_segment(routers[policy], solo, schedule)
            done, routing, spans = pooled[policy]
            pooled[policy] = (done + outcomes, routing + timings[policy][first:], spans + span)
            step(f"{rate:g}/s round {round_index + 1} {policy}")
    return pooled


def run_benchmark(settings: Settings) -> dict:
    from classifiers.calibrate import load_pools

    torch.set_num_threads(1)
    classifier, notes = gain_classifier(settings)
    prompts = settings.prompts
    if prompts is not None and not prompts.is_dir():
        notes.append(f"no prompts folder at {prompts}: subtasks only")
        prompts = None
    items = build_workload(settings.items, prompts, settings.max_tokens)
    pools = load_pools(str(settings.model))
    with tempfile.TemporaryDirectory() as scratch:
        profile, curve = write_profile(pools, settings.max_batch * 8, Path(scratch))
        solo, skipped = measure_solo(items, classifier, pools, curve)
        notes += skipped
        if not solo:
            raise InvalidRequestError("no workload request fits the model's context", param="max_tokens")
        capacity = len(solo) / sum(s.standard_s for s in solo)
        rates = [float(f"{multiple * capacity:.3g}") for multiple in settings.rates]
        results, shares = run_policies(settings, solo, rates, profile, classifier)
    threshold = classifier.threshold if settings.threshold is None else settings.threshold
    return report(settings, RunData(solo, capacity, rates, results, shares, curve, threshold, notes))


def run_policies(
    settings: Settings, solo: list[Solo], rates: list[float], profile: Path, classifier: DeterminismClassifier
) -> tuple[dict[str, dict[str, dict]], dict[str, list[tuple[float | None, bool]]]]:
    """Every policy's router, warmed up, through every rate; the summaries and who went to DSpark at what load."""
    oracle = OracleScorer({s.item.name: s.speedup for s in solo})
    results: dict[str, dict[str, dict]] = {policy: {} for policy in POLICIES}
    shares: dict[str, list[tuple[float | None, bool]]] = {policy: [] for policy in POLICIES}
    routers = {
        policy: build_router(
            policy, settings.model, settings.max_batch, profile, settings.seed, classifier, oracle, settings.threshold
        )
        for policy in POLICIES
    }
    try:
        for router in routers.values():
            warm_up(router)
        timings = {policy: time_decisions(router) for policy, router in routers.items()}
        with JobProgress(log_every=len(POLICIES)) as progress:
            job = progress.add_job("workload", total=len(rates) * settings.rounds * len(POLICIES))

            def step(status: str) -> None:
                progress.step(job, status=status)

            for index, rate in enumerate(rates):
                pooled = run_rate(routers, timings, solo, rate, settings, index * settings.rounds, step)
                for policy, (outcomes, routing, span) in pooled.items():
                    results[policy][f"{rate:g}"] = summarise(outcomes, routing, span)
                    shares[policy] += [(o.dspark_occupancy, o.pool == "dspark") for o in outcomes if o.pool]
    finally:
        for router in routers.values():
            router.close()
    return results, shares


def _by_group(solo: list[Solo]) -> dict[str, dict]:
    groups: dict[str, list[Solo]] = {}
    for s in solo:
        groups.setdefault(s.item.group, []).append(s)
    return {
        name: {
            "source": members[0].item.source,
            "requests": len(members),
            "median_speedup": float(np.median([s.speedup for s in members])),
            "median_predicted": float(np.median([s.predicted for s in members])),
        }
        for name, members in sorted(groups.items())
    }


def solo_routing(solo: list[Solo]) -> dict[str, dict]:
    """Per source (held-out subtasks, real prompts): the requests' solo time on the standard pool, on DSpark, as
    routed by the expected-gain model on idle pools (DSpark where it predicts a gain), and as an oracle routes
    them; ``routed_over_oracle`` is the issue's "within 10% of the oracle's" measure."""
    table = {}
    for source in sorted({s.item.source for s in solo}):
        members = [s for s in solo if s.item.source == source]
        standard = sum(s.standard_s for s in members)
        dspark = sum(s.standard_s / s.speedup for s in members)
        routed = sum(s.standard_s / s.speedup if s.predicted > 1.0 else s.standard_s for s in members)
        oracle = sum(min(s.standard_s, s.standard_s / s.speedup) for s in members)
        table[source] = {
            "requests": len(members),
            "standard_s": standard,
            "dspark_s": dspark,
            "routed_s": routed,
            "oracle_s": oracle,
            "routed_over_oracle": routed / oracle,
        }
    return table


def report(settings: Settings, data: RunData) -> dict:
    solo, results, shares = data.solo, data.results, data.shares
    keys = [f"{rate:g}" for rate in data.rates]
    measured, predicted = np.log([s.speedup for s in solo]), np.log([s.predicted for s in solo])
    return {
        "model": str(settings.model),
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "workload": {
            "requests": len(solo),
            "subtasks": sum(s.item.source == "subtask" for s in solo),
            "prompts": sum(s.item.source == "prompt" for s in solo),
            "subtask_share": SUBTASK_SHARE,
            "greedy": sum(s.item.greedy for s in solo),
            "max_tokens": settings.max_tokens,
            "arrivals_per_segment": settings.requests,
            "rounds": settings.rounds,
            "max_batch": settings.max_batch,
        },
        "single_worker_requests_per_s": data.capacity,
        "capacity": {
            policy: capacity(policy_config(policy, settings.model, settings.max_batch, None, settings.seed))
            for policy in POLICIES
        },
        "rate_multiples": list(settings.rates),
        "rates": keys,
        "policies": list(POLICIES),
        "classifier_threshold": data.threshold,
        "profile_steps_per_s": {str(tokens): rate for tokens, rate in data.curve.steps_per_s.items()},
        "results": results,
        "comparison": compare(results, keys),
        "speedup_by_group": _by_group(solo),
        "solo_routing": solo_routing(solo),
        "prediction": {
            "log_correlation": float(np.corrcoef(measured, predicted)[0, 1]) if len(solo) > 2 else None,
            "median_measured": float(np.exp(np.median(measured))),
            "median_predicted": float(np.exp(np.median(predicted))),
        },
        "dspark_share_by_occupancy": {
            policy: [[occupancy, routed] for occupancy, routed in pairs if occupancy is not None]
            for policy, pairs in shares.items()
            if any(occupancy is not None for occupancy, _ in pairs)
        },
        "items": [
            {
                "name": s.item.name,
                "group": s.item.group,
                "source": s.item.source,
                "split": s.item.split,
                "greedy": s.item.greedy,
                "speedup": s.speedup,
                "predicted": s.predicted,
                "standard_s": s.standard_s,
            }
            for s in solo
        ],
        "notes": data.notes,
    }


def _capacity_line(capacities: dict[str, dict]) -> str:
    shapes = {(c["workers"], c["slots"]) for c in capacities.values()}
    if len(shapes) == 1:
        workers, slots = shapes.pop()
        return f"every policy: {workers} workers, {slots} batch slots, one thread per worker"
    return "UNEQUAL capacity: " + ", ".join(f"{p} {c['workers']}w/{c['slots']}s" for p, c in capacities.items())


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_report(report: dict) -> str:
    """Two tables (latency; per request and routing), a row per rate and policy, then the targets: 80 columns."""
    lines = [
        f"bench workload: {report['workload']['requests']} requests "
        f"({report['workload']['subtasks']} subtasks, {report['workload']['prompts']} real prompts), "
        f"{report['workload']['rounds']} rounds of {report['workload']['arrivals_per_segment']} arrivals per "
        "policy and rate",
        f"one worker, one request at a time: {report['single_worker_requests_per_s']:.2f} req/s; "
        f"rates x{', x'.join(f'{m:g}' for m in report['rate_multiples'])}",
        f"classifier policy at threshold {report['classifier_threshold']:.2f}; time_saved and oracle weigh "
        "load on this machine's profile",
        _capacity_line(report["capacity"]),
        "",
        f"{'rate/s':>6} {'policy':<12} {'req/s':>6} {'tok/s':>6} {'mean s':>7} {'p50 s':>6} {'p95 s':>6} "
        f"{'p99 s':>6} {'TTFT s':>6}",
    ]
    for rate in report["rates"]:
        for policy in report["policies"]:
            r = report["results"][policy][rate]
            lines.append(
                f"{rate:>6} {policy:<12} {r['requests_per_s']:>6.2f} {r['tokens_per_s']:>6.0f} "
                f"{_cell(r['mean_latency_s'], '>7.2f')} {_cell(r['p50_latency_s'], '>6.2f')} "
                f"{_cell(r['p95_latency_s'], '>6.2f')} {_cell(r['p99_latency_s'], '>6.2f')} "
                f"{_cell(r['ttft_p50_s'], '>6.2f')}"
            )
    lines += [
        "",
        f"{'rate/s':>6} {'policy':<12} {'tok/s/r':>7} {'fwd/tok':>7} {'dspark':>6} {'route µs':>8} "
        f"{'p99 µs':>7} {'cpu p99':>7} {'greedy ≠':>8}",
    ]
    for rate in report["rates"]:
        for policy in report["policies"]:
            r = report["results"][policy][rate]
            mismatches = f"{r['greedy_mismatches']}/{r['greedy_checked']}"
            lines.append(
                f"{rate:>6} {policy:<12} {_cell(r['per_request_tokens_per_s'], '>7.1f')} "
                f"{_cell(r['forward_passes_per_token'], '>7.2f')} {_cell(r['dspark_share'], '>6.0%')} "
                f"{_cell(r['routing_p50_us'], '>8.0f')} {_cell(r['routing_p99_us'], '>7.0f')} "
                f"{_cell(r['routing_cpu_p99_us'], '>7.0f')} {mismatches:>8}"
            )
    lines.append("")
    for rate, entry in report["comparison"]["by_rate"].items():
        ratio = entry.get("oracle_saving_ratio")
        lines.append(
            f"{rate}/s: time_saved {'beats' if entry['beats_single_pools'] else 'does not beat'} both single "
            f"pools (mean, p95); saves {_cell(entry.get('saving_s'), '.3f')} s of the oracle's "
            f"{_cell(entry.get('oracle_saving_s'), '.3f')} s over {entry['better_single_pool']}"
            + (f" ({ratio:.0%})" if ratio is not None else "")
        )
    prediction = report["prediction"]
    lines.append(
        f"expected-gain model on these requests: log correlation {_cell(prediction['log_correlation'], '.2f')}, "
        f"median {prediction['median_predicted']:.2f}x predicted, {prediction['median_measured']:.2f}x measured"
    )
    for source, row in report["solo_routing"].items():
        lines.append(
            f"solo, {source}s: routed {row['routed_s']:.1f} s, oracle {row['oracle_s']:.1f} s "
            f"({row['routed_over_oracle']:.2f}x), standard {row['standard_s']:.1f} s, DSpark {row['dspark_s']:.1f} s"
        )
    lines += [f"note: {note}" for note in report["notes"]]
    return "\n".join(wrapped(line) for line in lines)


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    started = time.perf_counter()
    report = run_benchmark(settings)
    report["elapsed_s"] = round(time.perf_counter() - started, 1)
    print(format_report(report))
    print(f"finished in {report['elapsed_s']:.0f} s")
    write_json(args.json, report)
    write_plots(args.plots, report, workload_plots.draw_all)
    return 0

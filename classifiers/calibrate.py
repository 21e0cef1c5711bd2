"""Measure DSpark's speedup per subtask: each runs on DSpark (exact verification) and on plain autoregressive
decoding, one model in one process, interleaved and warm.

Both backends share the model's weights, so the only difference is the decode loop. Subtasks are taken in
blocks, each pool running the whole block in turn after one untimed run, the first pool alternating from block
to block (:func:`block_runs` says why not per subtask), so neither backend pays for cold caches, a CPU that is
clocking up, or the other loop's leftovers. Each run has a fixed seed, so repeats of it give the same output and
the fastest of ``repeats`` runs is the one kept: the usual way to take scheduling noise out.

A sampled subtask is measured over ``samples`` seeds: the router decides before anything is sampled, so the
quantity to learn is the speedup expected over the outputs the request can get, and one draw's luck (a short
answer, a run of rejected spans) is noise in that label. A greedy subtask has one output and needs one seed.
On the default model (a run of 64 tokens takes 2-3 s on 2 cores) the defaults are one run per seed and pool,
two seeds and 64 tokens: the whole corpus in about 80 minutes, and 48 subtasks measured twice that way agree
closely (log-speedup correlation 0.95, "faster" the same on 88%).

Speedup is standard time per output token over DSpark time per output token, totalled over the seeds: for the
greedy subtasks both produce the same tokens and this is plain wall-time ratio; for sampled ones the outputs
differ and per-token time keeps the comparison fair.
"""

from __future__ import annotations

import statistics
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from backends.autoregressive import AutoregressiveBackend
from backends.corpus.subtasks import Subtask
from backends.default_model import drafters_for
from backends.dspark.backend import DSparkBackend
from backends.dspark.curves import carry_factor, machine_key, stored_curves
from backends.dspark.profile import loaded_key
from backends.errors import InvalidRequestError
from backends.loading import resolve_device, resolve_precision
from backends.local import LocalBackend
from backends.progress import JobProgress
from backends.scheduling import PROFILE_FILE
from backends.types import GenerationRequest, GenerationResult
from classifiers.records import Measurement, Split

MAX_TOKENS = 64
REPEATS = 1
SAMPLES = 2
WARMUP_TOKENS = 8
DISTURBED = 2.0
BLOCK = 8
RETRIES = 2
TYPICAL_AFTER = 5
MIN_FORWARDS = 4
"""Forwards a pool's run needs for its disturbance to be judged: the prompt's and at least three more."""


def calibration_request(subtask: Subtask, max_tokens: int, seed: int) -> GenerationRequest:
    """The subtask as a client sends it (the backend adds the format and tool notes the model expects), its own
    sampling settings, max_tokens capped."""
    return GenerationRequest(
        messages=subtask.messages,
        response_format=subtask.response_format,
        tools=subtask.tools,
        temperature=subtask.temperature,
        top_p=subtask.top_p,
        max_tokens=min(subtask.max_tokens, max_tokens),
        stop=subtask.stop,
        seed=seed,
    )


def _pool_stats(results: Sequence[GenerationResult]) -> dict[str, float | int | str | bool]:
    """One pool's timings, averaged over the seeds a subtask ran with."""
    n = len(results)
    wall_time_s = sum(result.stats.wall_time_s for result in results) / n
    tokens = sum(result.usage.completion_tokens for result in results) / n
    stats = {
        "wall_time_s": wall_time_s,
        "first_token_s": sum(result.stats.time_to_first_token_s or 0.0 for result in results) / n,
        "tokens_per_s": tokens / wall_time_s if wall_time_s > 0 else 0.0,
        "completion_tokens": tokens,
        "forward_passes": sum(result.stats.forward_passes for result in results) / n,
        "finish_reason": results[0].finish_reason,
        "samples": n,
    }
    spans = [result.stats.spans for result in results if result.stats.spans is not None]
    if spans:
        stats["mean_accepted"] = statistics.mean(span.mean_accepted for span in spans)
    return stats


def _per_token_time(results: Sequence[GenerationResult]) -> float:
    return sum(r.stats.wall_time_s for r in results) / max(sum(r.usage.completion_tokens for r in results), 1)


def speedup_of(runs: dict[str, Sequence[GenerationResult]]) -> float:
    """Standard time per output token over DSpark's, over all the runs kept for each pool."""
    return _per_token_time(runs["standard"]) / _per_token_time(runs["dspark"])


Runs = dict[str, list[GenerationResult]]
"""Per pool, the fastest run of each seed of one request."""


def seeded(request: GenerationRequest, samples: int) -> list[GenerationRequest]:
    """The request once per seed it is measured with: one for a greedy request, ``samples`` for a sampled one."""
    seed = request.seed or 0
    draws = 1 if request.temperature == 0 else samples
    return [request.model_copy(update={"seed": seed * samples + draw}) for draw in range(draws)]


def block_runs(
    pools: dict[str, LocalBackend], requests: Sequence[GenerationRequest], repeats: int, samples: int, first: str
) -> list[Runs | InvalidRequestError]:
    """Every request of a block on one pool, then every request on the other (``first`` first): per request, the
    fastest of ``repeats`` runs for each seed, or the error that refused it.

    Pools take turns by block, never by request, because a run right after a run of the other pool was once
    about 18% slower than one after its own (same prompt, 64 tokens, bfloat16 on AMX: 2.9 s against 2.5 s for
    plain decoding, 2.7 s against 2.3 s for DSpark): the other engine's idle thread still held its OpenMP team
    (:data:`backends.engine.IDLE_EXIT_S`, then 1 s; the packed engine now runs on threads of its own).
    Alternating per request put that toll on one pool or the other by the request's parity: the same greedy subtask
    measured 1.73x with DSpark run first and 1.09x with it second. Each pool's turn starts with one untimed run of
    the block's first request, so whatever the switch still costs falls on no timed run."""
    runs: list[Runs | InvalidRequestError] = [{} for _ in requests]
    for name in [first, *(name for name in pools if name != first)]:
        settled = False
        for index, request in enumerate(requests):
            if isinstance(runs[index], InvalidRequestError):
                continue
            try:
                if not settled:
                    pools[name].complete(request)
                    settled = True
                runs[index][name] = [
                    min((pools[name].complete(draw) for _ in range(repeats)), key=lambda r: r.stats.wall_time_s)
                    for draw in seeded(request, samples)
                ]
            except InvalidRequestError as exc:
                runs[index] = exc
    return runs


def in_blocks(
    pools: dict[str, LocalBackend], requests: Sequence[GenerationRequest], repeats: int, samples: int
) -> Iterator[Runs | InvalidRequestError]:
    """:func:`block_runs` over :data:`BLOCK` requests at a time, the first pool alternating from block to block:
    each request's runs (or refusal) in order, yielded as its block is taken."""
    names = list(pools)
    for start in range(0, len(requests), BLOCK):
        first = names[(start // BLOCK) % len(names)]
        yield from block_runs(pools, requests[start : start + BLOCK], repeats, samples, first)


def summarise(runs: Runs) -> tuple[float, dict[str, dict]]:
    """(speedup, stats by pool) of one request's runs."""
    stats = {name: _pool_stats(results) for name, results in runs.items()}
    stats["dspark"]["same_output"] = all(
        d.token_ids == s.token_ids for d, s in zip(runs["dspark"], runs["standard"], strict=True)
    )
    return speedup_of(runs), stats


def load_pools(model: str, device: str = "auto", dtype: str = "auto") -> dict[str, LocalBackend]:
    """DSpark with exact verification and the autoregressive backend on the same loaded weights."""
    dspark = DSparkBackend.from_pretrained(model, device=device, dtype=dtype, verification="exact")
    return {"dspark": dspark, "standard": AutoregressiveBackend(dspark.loaded)}


def machine_profile(
    model: str, machine: str | None = None, device: str = "auto", dtype: str = "auto"
) -> dict[str, Any] | None:
    """The key of the machine the speedups were measured on (``machine``, else this one as ``device`` and
    ``dtype`` resolve here) and the model's cost curve there as stored with its drafters (the DSpark backend
    profiles it when it first loads on a machine), for the classifier to keep beside the speedups; None where
    none is stored."""
    if machine is None:
        resolved = resolve_device(device)
        machine = machine_key(resolved, resolve_precision(dtype, resolved, Path(model)))
    curve = stored_curves(drafters_for(model) / PROFILE_FILE).get(machine)
    return {"machine": machine, "steps_per_s": curve} if curve else None


def measured_on(records: Sequence[Measurement]) -> str | None:
    """The machine most of the measured records name, or None where none names one."""
    machines = Counter(r.machine for r in records if r.speedup is not None and r.machine is not None)
    return machines.most_common(1)[0][0] if machines else None


def carried_to(
    records: Sequence[Measurement], machine: str, curves: dict[str, dict[str, float]]
) -> tuple[list[Measurement], Counter[str], Counter[str]]:
    """The records with every speedup as it would be on ``machine``, so one classifier learns one machine's
    speedups: a record measured elsewhere is scaled by the two machines' cost curves (``curves``, as stored with
    the drafters), as the router carries speedups at decision time; one whose machine has no stored curve is left
    out, since nothing puts its speedup in the same units. Records naming no machine count as ``machine``'s.
    Returns the records kept and, by machine, how many were carried and how many left out."""
    factors = {elsewhere: carry_factor(curves, elsewhere, machine) for elsewhere in curves}
    kept: list[Measurement] = []
    carried: Counter[str] = Counter()
    left_out: Counter[str] = Counter()
    for record in records:
        if record.speedup is None or record.machine in (None, machine):
            kept.append(record)
        elif record.machine in factors:
            speedup = record.speedup * factors[record.machine]
            kept.append(record.model_copy(update={"speedup": speedup, "machine": machine}))
            carried[record.machine] += 1
        else:
            left_out[record.machine] += 1
    return kept, carried, left_out


def _seconds_per_forward(stats: dict[str, dict]) -> dict[str, float]:
    """Per pool, the mean seconds of a forward after the first token, the step a disturbance slows alike on every
    subtask; a pool with too few such forwards to tell is left out. Not the whole run's time per forward: the
    prompt's pass weighs in that by the prompt's length, and a subtask with a long prompt and a one-word answer
    (a classification) then ran "4x slower than usual" on an AMD EPYC Zen 4 on every try, undisturbed."""
    return {
        name: (pool["wall_time_s"] - pool["first_token_s"]) / (pool["forward_passes"] - 1)
        for name, pool in stats.items()
        if pool["forward_passes"] >= MIN_FORWARDS
    }


def _disturbance(per_forward: dict[str, float], typical: dict[str, list[float]]) -> float:
    """How much slower than usual this measurement's forwards ran, at worst over the pools: about 1 for a clean
    run, 10 where another process held the cores. 1 until a few runs have set what is usual."""
    ratios = [
        seconds / statistics.median(typical[name])
        for name, seconds in per_forward.items()
        if len(typical[name]) >= TYPICAL_AFTER
    ]
    return max(ratios, default=1.0)


def measure(
    pools: dict[str, LocalBackend],
    subtasks: Sequence[tuple[Subtask, Split]],
    max_tokens: int = MAX_TOKENS,
    repeats: int = REPEATS,
    samples: int = SAMPLES,
    on_skip: Callable[[Subtask, str], None] | None = None,
) -> Iterator[Measurement]:
    """One measurement per subtask, yielded as its block is taken (:func:`in_blocks`). A subtask the model cannot
    take (prompt longer than its context) is skipped and handed to ``on_skip`` with the reason.

    A measurement whose forwards ran :data:`DISTURBED` times slower than the usual on either pool was disturbed
    (another process took the cores for a while: seen here as 10 s for 10 tokens, a 22x "speedup") and is taken
    again, up to :data:`RETRIES` times, keeping the least disturbed: one such record would outweigh dozens of
    clean ones in the time the router learns to save. One still disturbed after its retries (the machine stalled
    for a minute: seen here as 19 s for a 0.25 s subtask on both pools) is skipped like a refused one, so a
    ``--resume`` measures it again. Each subtask's seed comes from its request, so a resumed
    or partial run draws what a whole run draws."""
    warmup = GenerationRequest(
        messages=[{"role": "user", "content": "Say hello."}], max_tokens=WARMUP_TOKENS, temperature=0.0
    )
    for backend in pools.values():
        backend.complete(warmup)
    loaded = pools["dspark"].loaded
    machine = loaded_key(loaded)
    typical: dict[str, list[float]] = {name: [] for name in pools}
    records = [
        Measurement(
            request=subtask.to_request_dict(),
            split=split,
            kind=subtask.kind,
            template=subtask.template,
            machine=machine,
        )
        for subtask, split in subtasks
    ]
    requests = [
        calibration_request(subtask, max_tokens, seed=zlib.crc32(record.canonical_request().encode()))
        for (subtask, _), record in zip(subtasks, records, strict=True)
    ]
    taken = in_blocks(pools, requests, repeats, samples)
    for (subtask, _), record, request, runs in zip(subtasks, records, requests, taken, strict=True):
        if isinstance(runs, InvalidRequestError):
            if on_skip is not None:
                on_skip(subtask, runs.message)
            continue
        speedup, stats = summarise(runs)
        best = (_disturbance(_seconds_per_forward(stats), typical), speedup, stats)
        for _ in range(RETRIES):
            if best[0] < DISTURBED:
                break
            again = next(in_blocks(pools, [request], repeats, samples))
            if not isinstance(again, InvalidRequestError):
                speedup, stats = summarise(again)
                candidate = (_disturbance(_seconds_per_forward(stats), typical), speedup, stats)
                best = min(best, candidate, key=lambda taken: taken[0])
        disturbance, speedup, stats = best
        if disturbance >= DISTURBED:
            if on_skip is not None:
                on_skip(subtask, f"its forwards ran {disturbance:.0f}x slower than usual on all {RETRIES + 1} tries")
            continue
        for name, seconds in _seconds_per_forward(stats).items():
            typical[name].append(seconds)
        yield record.model_copy(update={"speedup": speedup, "stats": stats})


def measure_with_progress(
    pools: dict[str, LocalBackend],
    subtasks: Sequence[tuple[Subtask, Split]],
    max_tokens: int,
    repeats: int,
    samples: int,
    console: Console,
) -> Iterator[Measurement]:
    """:func:`measure` behind a progress bar that shows the running median speedup."""
    speedups: list[float] = []

    def skip(subtask: Subtask, reason: str) -> None:
        console.print(f"[yellow]skipped {subtask.template}: {reason}")
        progress.step(task)

    with JobProgress() as progress:
        task = progress.add_job("calibrate", total=len(subtasks))
        for record in measure(pools, subtasks, max_tokens, repeats, samples, on_skip=skip):
            speedups.append(record.speedup)
            progress.step(task, status=f"median speedup {statistics.median(speedups):.2f}x")
            yield record


def summary_table(records: Sequence[Measurement], margin: float, elapsed_s: float) -> Table:
    """Per kind: subtasks, DSpark's mean accepted tokens, median speedup, share at or above the margin."""
    table = Table(title=f"{len(records)} subtasks measured in {elapsed_s:.1f} s")
    for column in ("kind", "subtasks", "mean accepted", "median speedup", f">= {margin}x"):
        table.add_column(column, justify="left" if column == "kind" else "right")
    by_kind: dict[str, list[Measurement]] = {}
    for record in records:
        by_kind.setdefault(record.kind or "(unknown)", []).append(record)
    for kind, group in sorted(by_kind.items()):
        accepted = [r.stats["dspark"].get("mean_accepted", 0.0) for r in group]
        table.add_row(
            kind,
            str(len(group)),
            f"{statistics.mean(accepted):.2f}",
            f"{statistics.median(r.speedup for r in group):.2f}x",
            f"{sum(r.speedup >= margin for r in group) / len(group):.0%}",
        )
    return table

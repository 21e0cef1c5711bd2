"""Measure DSpark's speedup per subtask: each runs on DSpark (exact verification) and on plain autoregressive
decoding, one model in one process, interleaved and warm.

Both backends share the model's weights, so the only difference is the decode loop. The order alternates from
one subtask to the next and every run is warm (one untimed run of each first), so neither backend pays for
cold caches or a CPU that is clocking up. Each run has a fixed seed, so repeats of it give the same output and
the fastest of ``repeats`` runs is the one kept: the usual way to take scheduling noise out.

A sampled subtask is measured over ``samples`` seeds: the router decides before anything is sampled, so the
quantity to learn is the speedup expected over the outputs the request can get, and one draw's luck (a short
answer, a run of rejected spans) is noise in that label. A greedy subtask has one output and needs one seed.
Which outputs were drawn is by far the larger noise: 30 sampled subtasks measured twice with the same seeds
agreed closely (log-speedup correlation 0.98), with another 4 seeds each only at 0.76, and a quarter of their
labels flipped. Hence the defaults of 12 seeds and 2 repeats rather than 4 and 3 (about 1.8x the time: 26
minutes for the shipped corpus on 2 cores).

Speedup is standard time per output token over DSpark time per output token, totalled over the seeds: for the
greedy subtasks both produce the same tokens and this is plain wall-time ratio; for sampled ones the outputs
differ and per-token time keeps the comparison fair.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator, Sequence

from rich.console import Console
from rich.table import Table

from backends.autoregressive import AutoregressiveBackend
from backends.dspark.backend import DSparkBackend
from backends.errors import InvalidRequestError
from backends.local import LocalBackend
from backends.progress import JobProgress
from backends.subtasks import Subtask
from backends.types import GenerationRequest, GenerationResult
from classifiers.records import Measurement, Split

DEFAULT_MAX_TOKENS = 128
WARMUP_TOKENS = 8


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


def fastest_runs(
    pools: dict[str, LocalBackend], request: GenerationRequest, repeats: int, dspark_first: bool, samples: int = 1
) -> dict[str, list[GenerationResult]]:
    """Per pool, the fastest of ``repeats`` interleaved runs for each seed: one seed for a greedy request,
    ``samples`` for a sampled one."""
    order = ["dspark", "standard"] if dspark_first else ["standard", "dspark"]
    seed = request.seed or 0
    draws = 1 if request.temperature == 0 else samples
    best: dict[str, list[GenerationResult]] = {name: [] for name in order}
    for draw in range(draws):
        seeded = request.model_copy(update={"seed": seed * samples + draw})
        fastest: dict[str, GenerationResult] = {}
        for _ in range(repeats):
            for name in order:
                result = pools[name].complete(seeded)
                if name not in fastest or result.stats.wall_time_s < fastest[name].stats.wall_time_s:
                    fastest[name] = result
        for name in order:
            best[name].append(fastest[name])
    return best


def measure_request(
    pools: dict[str, LocalBackend], request: GenerationRequest, repeats: int, dspark_first: bool, samples: int = 1
) -> tuple[float, dict[str, dict]]:
    """(speedup, stats by pool) from :func:`fastest_runs`."""
    best = fastest_runs(pools, request, repeats, dspark_first, samples)
    stats = {name: _pool_stats(results) for name, results in best.items()}
    stats["dspark"]["same_output"] = all(
        d.token_ids == s.token_ids for d, s in zip(best["dspark"], best["standard"], strict=True)
    )
    return speedup_of(best), stats


def load_pools(model: str, device: str = "auto", dtype: str = "auto") -> dict[str, LocalBackend]:
    """DSpark with exact verification and the autoregressive backend on the same loaded weights."""
    dspark = DSparkBackend.from_pretrained(model, device=device, dtype=dtype, verification="exact")
    return {"dspark": dspark, "standard": AutoregressiveBackend(dspark.loaded)}


def measure(
    pools: dict[str, LocalBackend],
    subtasks: Sequence[tuple[Subtask, Split]],
    max_tokens: int = DEFAULT_MAX_TOKENS,
    repeats: int = 1,
    samples: int = 1,
    on_skip: Callable[[Subtask, InvalidRequestError], None] | None = None,
) -> Iterator[Measurement]:
    """One measurement per subtask, yielded as it is taken. A subtask the model cannot take (prompt longer than
    its context) is skipped and handed to ``on_skip``."""
    warmup = GenerationRequest(
        messages=[{"role": "user", "content": "Say hello."}], max_tokens=WARMUP_TOKENS, temperature=0.0
    )
    for backend in pools.values():
        backend.complete(warmup)
    for index, (subtask, split) in enumerate(subtasks):
        try:
            request = calibration_request(subtask, max_tokens, seed=index)
            speedup, stats = measure_request(pools, request, repeats, dspark_first=index % 2 == 0, samples=samples)
        except InvalidRequestError as exc:
            if on_skip is not None:
                on_skip(subtask, exc)
            continue
        yield Measurement(
            request=subtask.to_request_dict(),
            speedup=speedup,
            stats=stats,
            split=split,
            kind=subtask.kind,
            template=subtask.template,
        )


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

    def skip(subtask: Subtask, exc: InvalidRequestError) -> None:
        console.print(f"[yellow]skipped {subtask.template}: {exc.message}")
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

"""The traffic of ``bench fleet``: agent runs arriving as a Poisson process, each a burst of dependent stages of
parallel subtasks, or the requests of a router's decision log replayed at its own pace.

Every simulated subtask is a draw of one measured request (an :class:`Item`): a calibration record of the kind
drawn, with the speedup DSpark had on it and the tokens it produced, or one line of a decision log. So a
subtask's speedup and length come from the same measurement, and the classifier scores the request that had them.

The kinds come in the proportions of ``classifiers/data/agent_mix.jsonl``, the hand-written requests of agents
that the corpus generator never wrote: the mix agents send. A run's shape (``AgentShape``) is an assumption,
stated there: a plan of 1 to 3 stages, each a fan-out of 1 to 6 subtasks sent at once (``Router.map``), a stage
sent when the one before it has answered in full, as ``examples/agent_pipeline.py`` sends its subtasks.

Arrivals are drawn once at one run per second and scaled to each rate, so every policy and every rate sees the
same runs of the same subtasks in the same order: differences between policies are theirs, not the draw's.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from backends.dspark.curves import closest_curve, stored_curves
from backends.scheduling import SpsCurve
from classifiers.records import Measurement, read_measurements
from router.decisions import RouteRecord

HELD_OUT = ("val", "test")
"""The calibration records' splits the classifier was not fitted on: drawn by default, so its predictions are
judged on requests it has not seen."""


@dataclass(frozen=True)
class Item:
    """One measured request that simulated subtasks are draws of."""

    name: str
    kind: str
    body: dict[str, Any]
    tokens: float
    """Forwards a standard worker runs for it alone: its completion tokens (prefill is not simulated), or for a
    replayed benchmark item its measured solo time in forwards, prefill included."""
    speedup: float
    """DSpark's solo speedup on it, as measured on the machine of ``measured_on``."""


@dataclass(frozen=True)
class Items:
    """The requests a trace draws from, and the cost curve of the machine their speedups were measured on (None:
    the simulated machine's own)."""

    items: list[Item]
    measured_on: SpsCurve | None


@dataclass(frozen=True)
class AgentShape:
    """One agent run: ``stages`` (inclusive range) stages in sequence, each of ``fanout`` parallel subtasks."""

    stages: tuple[int, int] = (1, 3)
    fanout: tuple[int, int] = (1, 6)


@dataclass(frozen=True)
class Trace:
    """Subtasks in run and stage order (arrays, a million subtasks are a million rows, not objects).

    Stage g holds subtasks ``stage_start[g]:stage_start[g + 1]`` of run ``stage_run[g]``; a run's stages are
    consecutive, its first is ``run_stage[r]``. ``unit_times`` are the runs' arrival times at scale 1 (one run per
    second for a synthetic trace, the log's own pace for a replay)."""

    items: Items
    item: np.ndarray
    rounding: np.ndarray
    """A uniform draw per subtask that rounds its forwards to a whole number without bias."""
    stage_start: np.ndarray
    stage_run: np.ndarray
    run_stage: np.ndarray
    unit_times: np.ndarray

    @property
    def subtasks(self) -> int:
        return len(self.item)

    @property
    def runs(self) -> int:
        return len(self.run_stage)

    def subtask_run(self) -> np.ndarray:
        """Each subtask's run."""
        return np.repeat(self.stage_run, np.diff(self.stage_start))

    def arrivals(self, scale: float) -> np.ndarray:
        """Run arrival times, in seconds, with the pace multiplied by ``scale``."""
        return self.unit_times / scale

    def mean_tokens(self) -> float:
        tokens = np.array([item.tokens for item in self.items.items])
        return float(tokens[self.item].mean())


def calibration_items(path: Path, splits: Sequence[str] = HELD_OUT) -> Items:
    """The measured records of the given splits, each an item of its kind, with the curve of their machine."""
    records, _ = read_measurements(path)
    chosen = [r for r in records if r.speedup is not None and r.kind is not None and r.resolved_split in splits]
    if not chosen:
        raise ValueError(f"{path} holds no measured record of the splits {', '.join(splits)}")
    items = [
        Item(name=r.template or f"{r.kind}/{i}", kind=r.kind, body=r.request, tokens=_tokens(r), speedup=r.speedup)
        for i, r in enumerate(chosen)
    ]
    return Items(items, _machine_curve({r.machine for r in chosen}))


def _tokens(record: Measurement) -> float:
    standard = record.stats.get("standard") or {}
    return max(1.0, float(standard.get("completion_tokens") or 1))


def _machine_curve(machines: set[str | None]) -> SpsCurve | None:
    """The stored curve of the records' one machine (``dspark_sps.json`` beside the default drafters)."""
    from backends.default_model import DEFAULT_DRAFTERS
    from backends.scheduling import PROFILE_FILE

    if len(machines) != 1 or None in machines:
        raise ValueError(f"the records must come from one machine, not {sorted(map(str, machines))}")
    stored = closest_curve(stored_curves(DEFAULT_DRAFTERS / PROFILE_FILE), machines.pop())
    return SpsCurve.from_stored(stored).monotone() if stored is not None else None


def kind_shares(mix: Path) -> dict[str, float]:
    """Each kind's share of the agent mix's requests."""
    counts = Counter(json.loads(line)["kind"] for line in mix.read_text(encoding="utf-8").splitlines() if line)
    total = sum(counts.values())
    return {kind: count / total for kind, count in sorted(counts.items())}


def synthetic_trace(items: Items, shares: dict[str, float], shape: AgentShape, subtasks: int, seed: int) -> Trace:
    """Agent runs until ``subtasks`` subtasks (the last run cut short), kinds drawn by ``shares``, each subtask
    one of its kind's items drawn uniformly."""
    rng = np.random.default_rng(seed)
    by_kind = {kind: [i for i, item in enumerate(items.items) if item.kind == kind] for kind in shares}
    kinds = [kind for kind in shares if by_kind[kind]]
    if not kinds:
        raise ValueError("no item of any kind of the mix")
    weights = np.array([shares[kind] for kind in kinds])
    mean_run = np.mean(shape.stages) * np.mean(shape.fanout)
    runs = int(subtasks / mean_run * 1.5) + 10
    stage_counts = rng.integers(shape.stages[0], shape.stages[1] + 1, size=runs)
    sizes = rng.integers(shape.fanout[0], shape.fanout[1] + 1, size=int(stage_counts.sum()))
    stage_run = np.repeat(np.arange(runs), stage_counts)
    stage_start = np.concatenate([[0], np.cumsum(sizes)])
    if stage_start[-1] < subtasks:
        raise ValueError("drew too few runs")  # 1.5 times the mean leaves this to astronomically bad luck
    stages = int(np.searchsorted(stage_start, subtasks, side="left"))
    stage_start, stage_run = stage_start[: stages + 1].copy(), stage_run[:stages]
    stage_start[-1] = subtasks
    run_count = int(stage_run[-1]) + 1
    run_stage = np.searchsorted(stage_run, np.arange(run_count), side="left")
    kind_of = rng.choice(len(kinds), size=subtasks, p=weights / weights.sum())
    pools = [np.array(by_kind[kind]) for kind in kinds]
    picks = rng.random(subtasks)
    item = np.empty(subtasks, dtype=np.int64)
    for k, pool in enumerate(pools):
        chosen = kind_of == k
        item[chosen] = pool[(picks[chosen] * len(pool)).astype(np.int64)]
    return Trace(
        items=items,
        item=item,
        rounding=rng.random(subtasks),
        stage_start=stage_start,
        stage_run=stage_run,
        run_stage=run_stage,
        unit_times=np.cumsum(rng.exponential(1.0, size=run_count)),
    )


def single_trace(items: Items, item: np.ndarray, times: np.ndarray, seed: int) -> Trace:
    """Each subtask a run of its own, arriving at ``times``: a replayed log, or a benchmark's schedule."""
    count = len(item)
    return Trace(
        items=items,
        item=np.asarray(item, dtype=np.int64),
        rounding=np.random.default_rng(seed).random(count),
        stage_start=np.arange(count + 1),
        stage_run=np.arange(count),
        run_stage=np.arange(count),
        unit_times=np.asarray(times, dtype=float),
    )


def replay_items(log: Path) -> tuple[Items, np.ndarray, dict[str, int]]:
    """The answered requests of a decision log (``log.jsonl``), in time order, and when each arrived (seconds
    from the first). Its measured speedup where a shadow run measured one; else the request is skipped, since a
    speedup nobody measured would be the simulation's invention. The counts say what was skipped and why."""
    rows, skipped = [], Counter()
    for line in log.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        record = RouteRecord.model_validate_json(line)
        tokens = (record.usage.completion_tokens if record.usage else 0) or 0
        if record.request is None or record.error is not None or tokens <= 0:
            skipped["no request, an error or no tokens"] += 1
        elif record.speedup is None:
            skipped["no measured speedup (no shadow run)"] += 1
        else:
            started = record.ts - (record.measured.latency_s if record.measured else 0.0)
            rows.append((started, record, tokens))
    if not rows:
        raise ValueError(f"{log} holds no answered request with a measured speedup (set policy.shadow)")
    rows.sort(key=lambda row: row[0])
    items = [
        Item(name=r.request_id, kind=r.decision.rule, body=r.request, tokens=float(tokens), speedup=r.speedup)
        for _, r, tokens in rows
    ]
    times = np.array([started - rows[0][0] for started, _, _ in rows])
    return Items(items, None), times, dict(skipped)

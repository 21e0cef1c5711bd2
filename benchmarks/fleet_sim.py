"""The discrete-event core of ``bench fleet``: pools of continuously batching workers, fed a trace, routed by a
decision function (the router's real policy, :mod:`benchmarks.fleet_policies`).

A pool is what :class:`~router.pools.InProcessPool` is: one FIFO queue in front of ``workers`` workers of
``max_batch`` rows each; an admitted request goes to the worker with the fewest in flight, and a full pool
(``workers * max_batch + max_queue`` admitted) refuses, which the dispatcher's ``overflow`` turns into a spill to
the other pool (:class:`~router.dispatch.Flight`). A worker decodes its rows in lockstep: every forward advances
each row by one step (a token, or a DSpark round), and costs what a forward of that many rows costs
(:meth:`~benchmarks.fleet_profiles.CostProfile.step_s`). A row joins or leaves at a forward's boundary.

Since every row of a worker advances one step per forward, a row needs a fixed number of forwards however long
each one takes: it finishes at the worker's forward count when it joined plus its steps. So a worker is a clock
(``t_base``, ``f_base``: the time and count of a forward boundary) and a heap of the forward counts at which its
rows finish; an event is the next of those on some worker, and the time between is never stepped through. That
is what lets a million subtasks on a thousand workers run in under a minute on one core: the work is per request
and per batch change, not per forward. What the simulation leaves out: prefill as a forward of its own (a
subtask's length is its decoding; a benchmark item's measured solo time holds its prefill), the KV cache's limit
on a batch, failures (so ``fallback`` never fires) and ``shadow`` replays.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from benchmarks.fleet_profiles import CostProfile
from benchmarks.fleet_trace import Trace
from router.load import PoolLoad

JOIN_TOLERANCE = 1e-6
"""In forwards: a request arriving this close after a boundary joins at it (float error, not a real wait)."""
PROGRESS_EVERY = 20_000


@dataclass(frozen=True)
class PoolSpec:
    name: str
    dspark: bool
    workers: int
    max_batch: int
    max_queue: int


class SimPool:
    """One pool's workers, queue and the counters its ``load`` reads, as the router's pools keep them."""

    def __init__(self, spec: PoolSpec, profile: CostProfile, steps: list[float]) -> None:
        self.spec = spec
        self.name = spec.name
        self.max_batch = spec.max_batch
        self.steps = steps
        """Forwards each item needs here, before rounding."""
        self.step_s = [0.0] + [profile.step_s(rows, spec.dspark) for rows in range(1, spec.max_batch + 1)]
        self.solo_tokens = profile.verify_tokens if spec.dspark else 1.0
        self.draft_s = profile.draft_s if spec.dspark else 0.0
        workers = spec.workers
        self.capacity = workers * spec.max_batch + spec.max_queue
        self.rows = [0] * workers
        self.t_base = [0.0] * workers
        self.f_base = [0] * workers
        self.finish: list[list[tuple[int, int]]] = [[] for _ in range(workers)]
        self.version = [0] * workers
        self.by_rows: list[dict[int, None]] = [dict.fromkeys(range(workers))] + [{} for _ in range(spec.max_batch)]
        self.least = 0
        self.queue: deque[int] = deque()
        self.running = 0

    def load(self) -> PoolLoad:
        return PoolLoad(
            depth=self.running + len(self.queue),
            running=self.running,
            workers=self.spec.workers,
            max_batch=self.max_batch,
            solo_tokens_per_forward=self.solo_tokens,
            draft_s=self.draft_s,
        )

    @property
    def full(self) -> bool:
        return self.running + len(self.queue) >= self.capacity

    def least_loaded(self) -> int | None:
        """A worker with the fewest rows, if one has room."""
        while self.least < self.max_batch and not self.by_rows[self.least]:
            self.least += 1
        return next(iter(self.by_rows[self.least])) if self.least < self.max_batch else None

    def _move(self, worker: int, rows: int) -> None:
        del self.by_rows[self.rows[worker]][worker]
        self.by_rows[rows][worker] = None
        self.rows[worker] = rows
        self.least = min(self.least, rows)

    def start(self, worker: int, subtask: int, forwards: int, now: float) -> None:
        """The row joins ``worker`` at its next forward boundary (at once on an idle worker)."""
        rows = self.rows[worker]
        if rows == 0:
            self.t_base[worker] = now
        else:
            tau = self.step_s[rows]
            ahead = math.ceil((now - self.t_base[worker]) / tau - JOIN_TOLERANCE)
            if ahead > 0:
                self.t_base[worker] += ahead * tau
                self.f_base[worker] += ahead
        heapq.heappush(self.finish[worker], (self.f_base[worker] + forwards, subtask))
        self._move(worker, rows + 1)
        self.running += 1

    def finish_due(self, worker: int) -> tuple[float, list[int]]:
        """Advance ``worker`` to its next finishing boundary; the time and the rows that finish there."""
        heap = self.finish[worker]
        due = heap[0][0]
        ahead = due - self.f_base[worker]
        if ahead > 0:
            self.t_base[worker] += ahead * self.step_s[self.rows[worker]]
            self.f_base[worker] = due
        done = []
        while heap and heap[0][0] <= self.f_base[worker]:
            done.append(heapq.heappop(heap)[1])
        self._move(worker, self.rows[worker] - len(done))
        self.running -= len(done)
        return self.t_base[worker], done

    def next_event(self, worker: int) -> float | None:
        """When ``worker``'s next row finishes at its present batch; None when idle. Invalidates older events."""
        self.version[worker] += 1
        if self.rows[worker] == 0:
            return None
        ahead = self.finish[worker][0][0] - self.f_base[worker]
        return self.t_base[worker] + ahead * self.step_s[self.rows[worker]]


@dataclass
class SimResult:
    """Per subtask: when it was sent and answered (NaN: refused), and where it ran (-1: refused)."""

    pools: list[str]
    dspark: list[bool]
    sent: np.ndarray
    done: np.ndarray
    pool: np.ndarray
    run_sent: np.ndarray
    run_done: np.ndarray
    rules: Counter
    explored: int
    spilled: int
    wall_s: float


Decide = Callable[[int], tuple[str, str, bool]]
"""An item's index to the decision: (pool, rule, explored)."""


class FleetSim:
    """One simulation: a trace through fresh pools, every subtask decided by ``decide`` as it is sent."""

    def __init__(self, trace: Trace, pools: list[SimPool], decide: Decide, overflow: dict[str, str]) -> None:
        self.trace = trace
        self.pools = pools
        self.by_name = {pool.name: index for index, pool in enumerate(pools)}
        self.decide = decide
        self.overflow = overflow

    def run(self, arrivals: np.ndarray, progress: Callable[[int], None] | None = None) -> SimResult:
        """``progress`` is told the number of subtasks answered, every few thousand."""
        started = time.perf_counter()
        trace, pools, by_name, decide, overflow = self.trace, self.pools, self.by_name, self.decide, self.overflow
        n = trace.subtasks
        item, rounding = trace.item.tolist(), trace.rounding.tolist()
        stage_start, stage_run = trace.stage_start.tolist(), trace.stage_run.tolist()
        run_stage = trace.run_stage.tolist()
        stage_count = len(stage_run)
        left = [stage_start[g + 1] - stage_start[g] for g in range(stage_count)]
        sent, done = np.full(n, np.nan), np.full(n, np.nan)
        placed = np.full(n, -1, dtype=np.int8)
        run_sent, run_done = np.asarray(arrivals, dtype=float).copy(), np.full(len(run_stage), np.nan)
        subtask_stage = np.repeat(np.arange(stage_count), np.diff(trace.stage_start)).tolist()
        rules: Counter = Counter()
        counts = {"explored": 0, "spilled": 0, "answered": 0}
        events: list[tuple[float, int, int, int, int]] = []
        dirty: set[tuple[int, int]] = set()
        sequence = 0

        def forwards(pool: SimPool, subtask: int) -> int:
            return max(1, int(pool.steps[item[subtask]] + rounding[subtask]))

        def send(subtask: int, now: float) -> None:
            sent[subtask] = now
            name, rule, explored = decide(item[subtask])
            rules[rule] += 1
            counts["explored"] += explored
            index = by_name[name]
            if pools[index].full:
                target = overflow.get(name)
                if target is None or pools[by_name[target]].full:
                    answered(subtask, now, refused=True)
                    return
                index = by_name[target]
                counts["spilled"] += 1
            placed[subtask] = index
            pool = pools[index]
            worker = pool.least_loaded()
            if worker is None:
                pool.queue.append(subtask)
                return
            pool.start(worker, subtask, forwards(pool, subtask), now)
            dirty.add((index, worker))

        def release(stage: int, now: float) -> None:
            for subtask in range(stage_start[stage], stage_start[stage + 1]):
                send(subtask, now)

        def answered(subtask: int, now: float, refused: bool = False) -> None:
            if not refused:
                done[subtask] = now
            stage = subtask_stage[subtask]
            left[stage] -= 1
            counts["answered"] += 1
            if progress is not None and counts["answered"] % PROGRESS_EVERY == 0:
                progress(counts["answered"])
            if left[stage]:
                return
            if stage + 1 < stage_count and stage_run[stage + 1] == stage_run[stage]:
                release(stage + 1, now)
            else:
                run_done[stage_run[stage]] = now

        def schedule() -> None:
            nonlocal sequence
            for index, worker in dirty:
                when = pools[index].next_event(worker)
                if when is not None:
                    sequence += 1
                    heapq.heappush(events, (when, sequence, index, worker, pools[index].version[worker]))
            dirty.clear()

        next_run, runs = 0, len(run_stage)
        arrival_times = run_sent.tolist()
        while True:
            arrival = arrival_times[next_run] if next_run < runs else math.inf
            if events and events[0][0] <= arrival:
                _, _, index, worker, version = heapq.heappop(events)
                pool = pools[index]
                if version != pool.version[worker]:
                    continue
                now, finished = pool.finish_due(worker)
                while pool.queue and pool.rows[worker] < pool.max_batch:
                    queued = pool.queue.popleft()
                    pool.start(worker, queued, forwards(pool, queued), now)
                dirty.add((index, worker))
                for subtask in finished:
                    answered(subtask, now)
            elif next_run < runs:
                release(run_stage[next_run], arrival)
                next_run += 1
            else:
                break
            schedule()
        return SimResult(
            pools=[pool.name for pool in pools],
            dspark=[pool.spec.dspark for pool in pools],
            sent=sent,
            done=done,
            pool=placed,
            run_sent=run_sent,
            run_done=run_done,
            rules=rules,
            explored=counts["explored"],
            spilled=counts["spilled"],
            wall_s=time.perf_counter() - started,
        )

"""The ``time_saved`` objective: a request's expected time on the DSpark and on the standard pool as they are
loaded right now, so the request goes where it finishes first.

For a pool whose target has a steps-per-second profile (``dspark_sps.json``, SPS(n) for a forward of n tokens):

    expected_time = (queued / slots + 1) * tokens / rate(b)

with b the batch the request would join. A standard request decodes one token per forward of a batch of b
one-token rows, so rate(b) = 1 / (1/SPS(b) + (b - 1) r), r what each row beyond the first adds outside a curve
measured on one request (``pools.NAME.load.row_s``: sampling, bookkeeping, padding; 0 unless configured). A
DSpark request decodes s(b) times faster, where the solo speedup s(1) the expected-gain model predicts shrinks
once the batch fills the machine, because every row verifies k + 1 tokens (``verify_tokens``), a forward of
b (k + 1) tokens costs more than one of b, the published drafter runs once per request, d seconds each
(``PoolLoad.draft_s``; 0 for span heads, which draft inside the forward), and each row adds its r:

    s(b) = max(floor, s(1) * SPS(1) * round(1) / (round(b) * SPS(b))),
    round(b) = 1 / SPS(b (k + 1)) + b d + (b - 1) r

This is the DSpark paper's load-aware verification budget one level up: the scheduler verifies less as the batch
grows, the router sends a DSpark pool fewer of the subtasks it barely speeds up. On an idle pool every subtask
with s(1) > 1 goes to DSpark; on a full one only those that still gain after the load's toll. The queue term
takes the request's own length as the others' (a queue of q drains in q / slots batches).

A pool without a profile (a remote engine) gets a plain depth-based estimate: ``tokens_per_s`` (else the pair's
profiled SPS(1) or the other pool's ``tokens_per_s``, else 1 token/s: a common unit, and the decision then
reports its saving as a share, not in seconds), times s(1) on the DSpark side, slowed by (depth / slots + 1).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from backends.default_model import drafters_for
from backends.scheduling import DEFAULT_VERIFY_TOKENS, PROFILE_FILE, SpsCurve, scaled_speedup
from router.config import PoolConfig, RouterConfig
from router.decisions import PoolSeen
from router.errors import ConfigError
from router.load import PoolLoad


@dataclass(frozen=True)
class PoolCost:
    """What a pool's decode rate under load is estimated from (``pools.NAME.load``)."""

    sps: SpsCurve | None = None
    verify_tokens: float | None = None
    speedup_floor: float = 0.0
    tokens_per_s: float | None = None
    row_s: float = 0.0

    @classmethod
    def from_config(cls, name: str, pool: PoolConfig) -> PoolCost:
        settings = pool.load
        return cls(
            sps=_profile(name, pool),
            verify_tokens=settings.verify_tokens,
            speedup_floor=settings.speedup_floor,
            tokens_per_s=settings.tokens_per_s,
            row_s=settings.row_s,
        )

    def plain_rate(self, batch: int) -> float:
        """Tokens per second a request decodes at in a plain batch of ``batch``: one a forward, the forward
        costing the curve's forward of ``batch`` tokens plus ``row_s`` for each row beyond the first."""
        return 1.0 / (1.0 / self.sps.at(batch) + (batch - 1) * self.row_s)


def _profile(name: str, pool: PoolConfig) -> SpsCurve | None:
    """The pool's curve: ``auto`` reads the profile stored with the pool's drafters (``drafter_path``, else the
    model's, :func:`~backends.default_model.drafters_for`) when there is one; a named file must hold one. Of the
    curves of several machines, this machine's (device, precision and threads as the pool would load the model),
    else the closest (:func:`~backends.dspark.profile.closest_curve`). Made monotone: a profile taken on a busy
    machine has slow outliers that would read as cheap long forwards."""
    setting = pool.load.profile
    if setting is None:
        return None
    explicit = setting != "auto"
    if not explicit and not pool.local:
        return None
    file = Path(setting) if explicit else Path(pool.drafter_path or drafters_for(pool.model)) / PROFILE_FILE
    if not explicit and not file.is_file():
        return None
    from backends.dspark.curves import closest_curve, stored_curves

    try:
        curves = stored_curves(file)
        stored = closest_curve(curves, _machine_key(pool) if pool.local else None)
        if stored is None:
            raise ValueError("no curve stored")
        return SpsCurve.from_stored(stored).monotone()
    except (OSError, ValueError, TypeError, AttributeError, IndexError) as exc:
        raise ConfigError(
            f"pools.{name}.load.profile", f"{str(file)!r} holds no steps-per-second curve ({exc})"
        ) from None


def _machine_key(pool: PoolConfig) -> str | None:
    """The key this machine's curve is stored under for the pool, as its workers would load the model; None where
    the model is not on this machine (a router in front of workers elsewhere)."""
    from backends.dspark.curves import pool_machine_key

    model = Path(pool.model)
    if not model.is_dir():
        return None
    return pool_machine_key(model, pool.device, pool.dtype, pool.threads)


@dataclass(frozen=True)
class PoolSide:
    name: str
    load: Callable[[], PoolLoad]
    cost: PoolCost


@dataclass(frozen=True)
class Verdict:
    pool: str
    seen: dict[str, PoolSeen]
    reason: str


class LoadEstimator:
    """Compares one request's expected time on the two pools; stateless, so decisions from many threads at once
    need no lock, and the same loads always give the same verdict."""

    def __init__(self, dspark: PoolSide, standard: PoolSide) -> None:
        self.dspark, self.standard = dspark, standard
        sides = (standard, dspark)
        known = [side.cost.sps.at(1) for side in sides if side.cost.sps is not None]
        known += [side.cost.tokens_per_s for side in sides if side.cost.tokens_per_s is not None]
        self._unit_rate = known[0] if known else 1.0
        self._in_seconds = bool(known)

    @classmethod
    def for_pools(cls, config: RouterConfig, loads: Mapping[str, Callable[[], PoolLoad]]) -> LoadEstimator:
        """The policy's dspark and standard pools, each read through ``loads[name]``."""

        def side(name: str) -> PoolSide:
            return PoolSide(name, loads[name], PoolCost.from_config(name, config.pools[name]))

        return cls(side(config.policy.dspark_pool), side(config.policy.standard_pool))

    def choose(self, solo_speedup: float, tokens: int, measured_on: SpsCurve | None = None) -> Verdict:
        """Where a request of ``tokens`` tokens with this solo speedup is expected to finish first; the standard
        pool on a tie (DSpark must gain something). ``measured_on``: the cost curve of the machine the solo
        speedup was measured on, when it is not this one."""
        dspark_load, standard_load = self.dspark.load(), self.standard.load()
        speedup = self._speedup_at(solo_speedup, dspark_load, measured_on)
        dspark = self._seen(dspark_load, self.dspark.cost, tokens, speedup)
        standard = self._seen(standard_load, self.standard.cost, tokens, None)
        to_dspark = _time(dspark) < _time(standard)
        winner, loser = (self.dspark.name, self.standard.name) if to_dspark else (self.standard.name, self.dspark.name)
        seen = {self.dspark.name: dspark, self.standard.name: standard}
        saving = _saving(seen[loser], seen[winner], self._in_seconds)
        reason = (
            f"expected {solo_speedup:.2f}x solo, {speedup:.2f}x at {self.dspark.name} {_batch(dspark)} "
            f"vs {self.standard.name} {_batch(standard)}: {winner} saves {saving}"
        )
        return Verdict(winner, seen, reason)

    def _speedup_at(self, solo: float, load: PoolLoad, measured_on: SpsCurve | None = None) -> float:
        """s(b) for the batch the request would join; the solo speedup where there is no profile to scale it.

        A DSpark round at batch b costs the forward of b (k + 1) tokens plus b drafter passes (``draft_s`` each,
        0 for span heads) and yields the request what it yields alone; a plain step costs the forward of b
        tokens. So s(b) = s(1) * SPS(1) * round(1) / (round(b) * SPS(b)), round(b) = 1/SPS(b (k + 1)) + b d.

        The same holds from one machine to another, the acceptance being the model's: a solo speedup measured
        where verifying k + 1 tokens costs 1.06 steps (bfloat16 with AMX) shrinks where it costs 1.8 (float32
        on AVX2), so SPS(1) * round(1) in the numerator is the measuring machine's (``measured_on``)."""
        sps = self.dspark.cost.sps
        if sps is None:
            return solo
        verify = self.dspark.cost.verify_tokens or load.solo_tokens_per_forward or DEFAULT_VERIFY_TOKENS
        row_s = self.dspark.cost.row_s
        speedup = scaled_speedup(solo, measured_on or sps, sps, load.batch, verify, load.draft_s, row_s)
        return max(self.dspark.cost.speedup_floor, speedup)

    def _seen(self, load: PoolLoad, cost: PoolCost, tokens: int, speedup: float | None) -> PoolSeen:
        gain = 1.0 if speedup is None else speedup
        expected: float | None
        if load.slots == 0:  # no live worker: nothing there would ever answer
            expected = None
        elif cost.sps is not None:  # a DSpark pool's rows pay their per-row cost in its speedup's round
            rate = cost.plain_rate(load.batch) if speedup is None else cost.sps.at(load.batch) * gain
            expected = (load.queued / load.slots + 1) * tokens / rate
        else:
            expected = (load.depth / load.slots + 1) * tokens / ((cost.tokens_per_s or self._unit_rate) * gain)
        return PoolSeen(
            depth=load.depth,
            running=load.running,
            workers=load.workers,
            max_batch=load.max_batch,
            batch=load.batch,
            speedup=speedup,
            expected_s=expected,
        )


def _time(seen: PoolSeen) -> float:
    return math.inf if seen.expected_s is None else seen.expected_s


def _batch(seen: PoolSeen) -> str:
    queued = seen.depth - seen.running
    return f"batch {seen.batch}/{seen.max_batch}" + (f" +{queued} queued" if queued > 0 else "")


def _saving(slower: PoolSeen, faster: PoolSeen, in_seconds: bool) -> str:
    """The expected saving, in seconds where some rate is known, else as a share of the slower pool's time."""
    if slower.expected_s is None:
        return "everything (the other pool has no live worker)"
    if faster.expected_s is None:
        return "nothing (neither pool has a live worker)"
    saved = slower.expected_s - faster.expected_s
    share = saved / slower.expected_s if slower.expected_s > 0 else 0.0
    return f"{saved:.2f} s ({share:.0%})" if in_seconds else f"{share:.0%} (relative: no profile or tokens_per_s)"

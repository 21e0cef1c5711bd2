"""How many draft tokens to verify: the paper's Algorithm 1 (confidence and hardware), or a static threshold.

Verifying a token costs target time, which on real hardware is not linear in the forward length: a short
forward is memory-bound and nearly as fast as a single token, a long one compute-bound. Algorithm 1 weighs the
expected number of committed tokens tau against the target's profiled steps per second SPS(B) at forward length
B. Over R active requests it admits candidates (request r, draft position j) in descending order of prefix
survival a_{r,j} = prod_{i<=j} c_{r,i}, from B = R and tau = R (every request's bonus token), while tau * SPS(B)
improves, and stops at the first candidate that does not improve it. That early stop is what keeps verification
lossless: whether token j is verified then depends only on a_{r,1..j}, which depend only on draft tokens before
j, never on token j itself. A retrospective search for the best prefix of the whole sorted list would let
a_{r,j+1} (computed from token j) decide whether token j is verified, and that biases the output (Appendix A).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Literal

Lookup = Literal["off", "beside", "only"]
"""Blocks copied from the context: none, beside the drafter's, or only those."""

TIE = 1e-9
"""Relative margin below which tau * SPS counts as not improved: a compute-bound forward ties exactly, in theory."""
PROFILE_FILE = "dspark_sps.json"
"""Beside the model: one stored curve per machine key (``backends/dspark/profile.py``), read by the router too."""
FASTEST_SHARE = 0.25
"""A round priced below the profiled forward (:meth:`SpsCurve.plus`) is taken to cost at least this share of it."""
DEFAULT_VERIFY_TOKENS = 4.0
"""k + 1 for a DSpark pool before it has decoded a request alone: the span heads' longest span."""


@dataclass(frozen=True)
class SpsCurve:
    """Target forward passes per second by forward length in tokens (1, 2, ...), as profiled; with
    ``overhead_s`` and ``per_token_s``, rounds per second of a loop whose rounds cost that much beyond their
    forward, once and per token (:meth:`plus`)."""

    steps_per_s: dict[int, float]
    overhead_s: float = 0.0
    per_token_s: float = 0.0

    @classmethod
    def from_stored(cls, stored: Mapping[str, float]) -> SpsCurve:
        """One machine's curve as ``dspark_sps.json`` stores it (JSON keys are strings)."""
        return cls({int(tokens): float(rate) for tokens, rate in stored.items()})

    def monotone(self) -> SpsCurve:
        """The curve with no forward slower than a longer one: timing noise (a busy machine) only ever adds time,
        and more tokens never cost less, so each length keeps the fastest rate of any length at or above it."""
        rates, fastest = {}, 0.0
        for tokens in sorted(self.steps_per_s, reverse=True):
            fastest = max(fastest, self.steps_per_s[tokens])
            rates[tokens] = fastest
        return SpsCurve(dict(sorted(rates.items())))

    def at(self, tokens: int) -> float:
        """Between profiled lengths, the forward time is interpolated; beyond them a forward is taken to be
        compute-bound: its time grows with its length."""
        shortest, table = self._table
        rate = table[tokens - shortest] if shortest <= tokens < shortest + len(table) else self._rate(tokens)
        if not self.overhead_s and not self.per_token_s:
            return rate
        return 1.0 / max(1.0 / rate + self.overhead_s + self.per_token_s * tokens, FASTEST_SHARE / rate)

    def plus(self, seconds: float, per_token_s: float = 0.0) -> SpsCurve:
        """This curve for rounds that each cost ``seconds`` plus ``per_token_s`` a token more than their forward
        (what an engine's rounds measured beyond it, :class:`RoundCost`), or less where ``seconds`` is negative: the
        machine runs faster than when it was profiled (a noisy host's clocks). Its table is this one's, not worked
        out again."""
        curve = SpsCurve(self.steps_per_s, seconds, per_token_s)
        curve.__dict__["_table"] = self._table  # what cached_property would compute: the forward's own rates
        return curve

    @cached_property
    def _table(self) -> tuple[int, list[float]]:
        """:meth:`at` for every length from the shortest profiled to the longest, worked out once: the scheduler
        asks it some 60 times a round for every drafting request (each candidate length's rate and its
        neighbour's), which at 16 rows was a tenth of the engine's time between forwards."""
        if not self.steps_per_s:
            return 1, []
        shortest, longest = min(self.steps_per_s), max(self.steps_per_s)
        return shortest, [self._rate(tokens) for tokens in range(shortest, longest + 1)]

    def _rate(self, tokens: int) -> float:
        if tokens in self.steps_per_s:
            return self.steps_per_s[tokens]
        lengths = sorted(self.steps_per_s)
        if tokens > lengths[-1]:
            return self.steps_per_s[lengths[-1]] * lengths[-1] / tokens
        upper = next(n for n in lengths if n > tokens)
        lower = max(n for n in lengths if n < tokens)
        share = (tokens - lower) / (upper - lower)
        seconds = (1 - share) / self.steps_per_s[lower] + share / self.steps_per_s[upper]
        return 1.0 / seconds


def scaled_speedup(
    solo: float,
    measured_on: SpsCurve,
    here: SpsCurve,
    batch: int = 1,
    verify: float = DEFAULT_VERIFY_TOKENS,
    draft_s: float = 0.0,
    row_s: float = 0.0,
) -> float:
    """A solo speedup measured on the machine of ``measured_on`` as it is expected ``here`` at a batch of
    ``batch``: s * SPS_m(1) * round_m(1) / (round_h(b) * SPS_h(b)), round(b) = 1/SPS(b * verify) + b * draft_s
    + (b - 1) * row_s, the last term what each row beyond the first adds outside the curve (see
    :meth:`router.expected_time.LoadEstimator._speedup_at`)."""

    def round_s(curve: SpsCurve, rows: int) -> float:
        return 1.0 / curve.at(max(rows, round(rows * verify))) + rows * draft_s + (rows - 1) * row_s

    return solo * measured_on.at(1) * round_s(measured_on, 1) / (round_s(here, batch) * here.at(batch))


def choose_lengths(survival: Sequence[Sequence[float]], sps: SpsCurve, rows: int | None = None) -> list[int]:
    """Algorithm 1: how many draft tokens of each request to verify this step, given each request's prefix
    survivals a_{r,1..gamma} (non-increasing along a request's block, so admitting in descending order keeps
    every request's verified tokens a prefix of its draft). ``rows`` counts every request in the forward pass,
    those without a draft too (each brings one certain token); by default, the requests in ``survival``."""
    candidates = sorted(
        ((a, r, j) for r, row in enumerate(survival) for j, a in enumerate(row)), key=lambda c: (-c[0], c[1], c[2])
    )
    lengths = [0] * len(survival)
    batch = len(survival) if rows is None else rows
    expected = float(batch)
    best = expected * sps.at(batch)
    for a, r, _ in candidates:
        value = (expected + a) * sps.at(batch + 1)
        if value <= best * (1 + TIE):
            break
        batch, expected, best = batch + 1, expected + a, value
        lengths[r] += 1
    return lengths


def draft_budget(
    sps: SpsCurve, rows: int, limit: int, expected: Sequence[float] | None = None, draft_s: float = 0.0
) -> int:
    """The most draft tokens worth drafting for one request in a forward of ``rows`` requests, decided before
    anything is drafted, so it changes no verification decision.

    Two gates. Algorithm 1's own: candidate k can only be admitted if SPS(rows + k) > rows * (SPS(rows + k - 1)
    - SPS(rows + k)), its condition at the best case (survival 1, tau at its least), so under heavy load (a
    compute-bound forward) nothing is. And the drafter's: a drafter pass costs ``draft_s`` on top of the forward,
    which the paper's GPU drafter makes negligible and a small CPU target does not; drafting k tokens pays only
    if the batch's tokens per second, rows + sum of the first k ``expected`` prefix survivals (this request's
    own so far: they depend on no draft yet made) over the forward plus the pass, beat the rows alone."""
    ceiling = limit
    for k in range(1, limit + 1):
        if sps.at(rows + k) <= rows * (sps.at(rows + k - 1) - sps.at(rows + k)) + TIE * sps.at(rows + k):
            ceiling = k - 1
            break
    if not draft_s or not ceiling:
        return ceiling
    survival = list(expected or []) + [1.0] * ceiling
    best, chosen = rows * sps.at(rows), 0
    for k in range(1, ceiling + 1):
        rate = (rows + sum(survival[:k])) / (1.0 / sps.at(rows + k) + draft_s)
        if rate > best * (1 + TIE):
            best, chosen = rate, k
    return chosen


def prefix_survival(confidence: Sequence[float]) -> list[float]:
    survival, product = [], 1.0
    for c in confidence:
        product *= c
        survival.append(product)
    return survival


class RoundCost:
    """What an engine's rounds cost beyond the profiled forward of the tokens they feed: a fixed part and a part
    per token fed, a least-squares line over recent rounds (running means, recent rounds weighing most), so
    Algorithm 1 weighs a verified token against the whole round it lengthens, at what a token really adds to it.

    The curve is profiled on one sequence after a short context, and a round is more: the forward of R rows reads
    each row's own keys and values (16 rows after 400 tokens of context: 25.8 ms against 10.4 ms for one row of 16
    tokens, Intel Xeon with AMX, 2 cores), and each row's loop runs its Python between forwards (its grammar's
    masks, lookups, verification). Against the curve alone an extra token looked three times dearer than it was:
    at 16 rows Algorithm 1 admitted only drafts all but certain, and the DSpark pool ran at 0.84x plain batching
    on an agent's templated traffic whose answers the traffic cache drafts well. Past a short context a token also
    costs more than the curve's slope (each verified token's attention over the context, and its argmax and
    bookkeeping): on that Xeon a lone request verified copies at 0.15 tokens kept a round on MT-Bench, 0.73x plain
    decoding, and priced per token 0.83x. And a round may cost less than its forward was profiled at, on a host
    whose clocks have changed since (a lone step in 2.9 ms against the curve's 4.3): the fixed part is then
    negative. Prefills are left out (a request's cost, not a round's), and so is drafting, which the budget weighs
    on its own (``draft_s``). Measured from earlier rounds only, so no round's verification depends on its own
    draft."""

    WEIGHT = 0.1
    SPREAD = 0.25
    """The least variance of the tokens fed (rounds of one length say nothing of a token's cost) before a slope is
    read; until then, and where the line slopes down (noise), a token costs what the curve says."""

    def __init__(self) -> None:
        self.seconds = 0.0
        """Mean seconds beyond the curve."""
        self.tokens = 0.0
        """Mean tokens fed."""
        self.variance = self.covariance = 0.0
        self.rounds = 0
        self._curve: SpsCurve | None = None
        self._priced: SpsCurve | None = None

    def add(self, seconds: float, tokens: int, sps: SpsCurve) -> None:
        """One round of ``seconds`` (its prefill left out) that fed ``tokens``, priced by the profiled ``sps``."""
        weight = self.WEIGHT if self.rounds else 1.0
        dx, dy = tokens - self.tokens, seconds - 1.0 / sps.at(tokens) - self.seconds
        self.tokens += weight * dx
        self.seconds += weight * dy
        self.variance += weight * ((1 - weight) * dx * dx - self.variance)
        self.covariance += weight * ((1 - weight) * dx * dy - self.covariance)
        self.rounds += 1
        self._priced = None

    @property
    def per_token_s(self) -> float:
        """Seconds a token fed adds beyond the curve's slope."""
        return max(0.0, self.covariance / self.variance) if self.variance > self.SPREAD else 0.0

    def priced(self, schedule: VerifySchedule) -> VerifySchedule:
        """``schedule`` weighing rounds as they have cost (itself where it does not weigh a curve)."""
        if not schedule.batched or not self.rounds:
            return schedule
        if self._priced is None or self._curve is not schedule.sps:
            slope = self.per_token_s
            self._curve, self._priced = schedule.sps, schedule.sps.plus(self.seconds - slope * self.tokens, slope)
        return replace(schedule, sps=self._priced)


class DraftCost:
    """What one drafter pass really costs in the decode loop (the drafter's context update and its draft), a
    running mean over a pool's recent rounds that starts from the load-time measurement (``VerifySchedule.draft_s``).

    The load-time figure times each part alone on warm buffers, and in the loop a pass took half as long again
    (AMD EPYC Zen 4: 3.1 ms against 2.1 ms), enough to make drafting look worth it where it was not: the hybrid
    drafted rounds that a copied block or a plain step would have done faster. The pool keeps one for all its
    requests, since the cost belongs to the drafter and the machine, not to a request. The first pass measured
    replaces the load-time figure outright, since that one is known to run low."""

    WEIGHT = 0.1

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.passes = 0

    def add(self, seconds: float) -> None:
        self.seconds += (self.WEIGHT if self.passes else 1.0) * (seconds - self.seconds)
        self.passes += 1


@dataclass(frozen=True)
class VerifySchedule:
    """A pool's (or request's) rule for the verification length of one request per round.

    ``threshold`` set: DeepSpec's static policy, verify up to the first position whose c_k falls below it (kept
    for comparison with the paper's Figure 5). Otherwise Algorithm 1 over this one request with ``sps``; with no
    profile at all, the whole block, as a fixed-length verifier would.
    ``verification`` "confidence" commits the scheduled draft unverified (lossy; the span heads' same option).
    """

    sps: SpsCurve | None = None
    threshold: float | None = None
    max_draft: int | None = None
    verification: Literal["exact", "confidence"] = "exact"
    draft_s: float = 0.0
    """Seconds of one drafter pass, which drafting must pay back (measured when the drafter loads; in the loop, the
    pool's :class:`DraftCost`)."""
    lookup: Lookup = "off"
    """Blocks copied from the context (:mod:`backends.dspark.lookup`) beside the drafter's, or only those."""
    trees: bool = False
    """Looked-up blocks that disagree verified together as one token tree (:mod:`backends.dspark.tree`). Off by
    default: on a 2-core CPU, where every verified token costs, trees committed 1-4% more tokens a forward on the
    agent trace but ran 1-3% slower (README, "Token trees"); where a verified token is nearly free (a GPU), a pool
    or request turns them on."""

    @property
    def batched(self) -> bool:
        """Whether Algorithm 1 over the profile decides, which across a batch is one choice for every request."""
        return self.sps is not None and self.threshold is None

    def budget(self, rows: int, limit: int, expected: Sequence[float] | None = None) -> int:
        """Draft tokens worth drafting at a batch of ``rows`` (see :func:`draft_budget`)."""
        return draft_budget(self.sps, rows, limit, expected, self.draft_s) if self.batched else limit

    def limit(self, block_size: int) -> int:
        return block_size if self.max_draft is None else min(block_size, self.max_draft)

    def length(self, confidence: Sequence[float], limit: int) -> int:
        """Draft tokens to verify out of ``limit`` drafted; without a confidence head, all of them."""
        if not confidence or (self.threshold is None and self.sps is None):
            return limit
        if self.threshold is not None:
            below = [k for k, c in enumerate(confidence) if c < self.threshold]
            return min(limit, below[0] if below else len(confidence))
        return min(limit, choose_lengths([prefix_survival(confidence)], self.sps)[0])


def schedule_batch(requests: Sequence[tuple[VerifySchedule, Sequence[float], int]], rows: int) -> list[int]:
    """Verification lengths for this step's drafting requests, given as (schedule, confidences, drafted), in a
    forward of ``rows`` requests. Those scheduled by Algorithm 1 over a profile share one choice across the
    batch, the paper's setting; the others (a static threshold, a fixed block) follow their own rule."""
    lengths = [schedule.length(confidence, limit) for schedule, confidence, limit in requests]
    joint = [i for i, (schedule, confidence, _) in enumerate(requests) if schedule.batched and confidence]
    if joint:
        sps = requests[joint[0]][0].sps
        survival = [prefix_survival(requests[i][1][: requests[i][2]]) for i in joint]
        for i, length in zip(joint, choose_lengths(survival, sps, rows)):
            lengths[i] = length
    return lengths

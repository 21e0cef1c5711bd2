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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class SpsCurve:
    """Target forward passes per second by forward length in tokens (1, 2, ...), as profiled."""

    steps_per_s: dict[int, float]

    def at(self, tokens: int) -> float:
        """Beyond the profiled lengths a forward is taken to be compute-bound: its time grows with its length."""
        if tokens in self.steps_per_s:
            return self.steps_per_s[tokens]
        longest = max(self.steps_per_s)
        return self.steps_per_s[longest] * longest / tokens


def choose_lengths(survival: Sequence[Sequence[float]], sps: SpsCurve) -> list[int]:
    """Algorithm 1: how many draft tokens of each request to verify this step, given each request's prefix
    survivals a_{r,1..gamma} (non-increasing along a request's block, so admitting in descending order keeps
    every request's verified tokens a prefix of its draft)."""
    candidates = sorted(
        ((a, r, j) for r, row in enumerate(survival) for j, a in enumerate(row)), key=lambda c: (-c[0], c[1], c[2])
    )
    lengths = [0] * len(survival)
    batch = len(survival)
    expected = float(batch)
    best = expected * sps.at(batch)
    for a, r, _ in candidates:
        value = (expected + a) * sps.at(batch + 1)
        if value <= best:
            break
        batch, expected, best = batch + 1, expected + a, value
        lengths[r] += 1
    return lengths


def prefix_survival(confidence: Sequence[float]) -> list[float]:
    survival, product = [], 1.0
    for c in confidence:
        product *= c
        survival.append(product)
    return survival


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

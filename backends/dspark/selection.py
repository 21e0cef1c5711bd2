"""Multi-granularity span selection: how many tokens to propose this step.

The confidence of a span of length L is the product of the top-1 probabilities of the L-1 draft tokens it
adds to the base model's own next token. The longest allowed length whose confidence clears its threshold
wins; failing that, shorter ones; failing all, a single token (plain decoding for that step). Proposing
less when unsure matters: a rejected draft costs compute in the verifying pass and buys nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backends.types import DSparkOptions


@dataclass(frozen=True)
class SpanPolicy:
    span_lengths: tuple[int, ...]
    thresholds: dict[int, float]
    verification: str = "exact"

    @classmethod
    def resolve(cls, pool: SpanPolicy, options: DSparkOptions | None, num_heads: int) -> SpanPolicy:
        """The pool's policy with a request's overrides applied, clipped to what the heads can draft."""
        lengths, thresholds, verification = pool.span_lengths, dict(pool.thresholds), pool.verification
        if options is not None:
            if options.thresholds is not None:
                thresholds.update(options.thresholds)
                lengths = tuple(sorted({1, *lengths, *options.thresholds}))
            if options.max_span is not None:
                lengths = tuple(n for n in lengths if n <= options.max_span)
            verification = options.verification or verification
        lengths = tuple(n for n in lengths if n <= num_heads + 1) or (1,)
        return cls(span_lengths=lengths, thresholds=thresholds, verification=verification)

    @property
    def longest(self) -> int:
        return max(self.span_lengths)

    def choose(self, draft_top_probs: torch.Tensor) -> tuple[int, list[int]]:
        """The span length to propose and every length whose confidence cleared its threshold."""
        confidence = torch.cumprod(draft_top_probs.float(), dim=0).tolist()
        cleared = [n for n in self.span_lengths if n > 1 and confidence[n - 2] >= self.thresholds.get(n, 1.0)]
        return (max(cleared) if cleared else 1), cleared

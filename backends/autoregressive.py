"""Plain autoregressive decoding: the standard pool's local backend and DSpark's reference.

prefill runs the whole prompt once; each decode step feeds the one token just chosen. Alone in the batch it is
the same computation ``model.generate()`` does, so greedy output matches it token for token. Under a grammar
the logits are masked before the choice, and tokens the grammar forces are committed together in one pass.
The engine batches this loop with every other running request's (see :mod:`backends.engine`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from backends.constraints import GrammarConstraint
from backends.engine import BatchLimits
from backends.loading import load_shared
from backends.local import LocalBackend
from backends.sampling import pick_allowed
from backends.steps import DecodeLoop, Forward
from backends.types import GenerationRequest, GenerationStats


class AutoregressiveBackend(LocalBackend):
    name = "autoregressive"

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: str = "auto",
        dtype: str = "auto",
        limits: BatchLimits | None = None,
        threads: int | None = None,
    ) -> AutoregressiveBackend:
        return cls(load_shared(path, device=device, dtype=dtype, threads=threads), limits)

    def _decode(
        self,
        prompt: list[int],
        request: GenerationRequest,
        generator: torch.Generator | None,
        stats: GenerationStats,
        constraint: GrammarConstraint | None,
    ) -> DecodeLoop:
        logits = (yield Forward(prompt)).logits[-1]
        stats.forward_passes += 1
        while True:
            tokens = forced_tokens(constraint, stats)
            if not tokens:
                tokens = [pick_allowed(logits, request, generator, constraint)]
                if constraint is not None:
                    constraint.consume(tokens)
            yield tokens
            logits = (yield Forward(tokens)).logits[-1]
            stats.forward_passes += 1


def forced_tokens(constraint: GrammarConstraint | None, stats: GenerationStats) -> list[int]:
    """Jump-forward: what the grammar forces next, committed at once and fed to the model in one pass."""
    if constraint is None:
        return []
    tokens = constraint.forced_tokens()
    if tokens:
        constraint.consume(tokens)
        stats.forced_tokens += len(tokens)
    return tokens

"""DSparkBackend: the DSpark pool's decoder behind the shared Backend protocol."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from backends.constraints import GrammarConstraint
from backends.dspark.decode import decode
from backends.dspark.model import DSparkModel
from backends.dspark.selection import SpanPolicy
from backends.local import LocalBackend
from backends.types import GenerationRequest, GenerationStats


class DSparkBackend(LocalBackend):
    name = "dspark"

    def __init__(self, model: DSparkModel, policy: SpanPolicy | None = None) -> None:
        super().__init__(model.loaded)
        self.model = model
        config = model.dspark_config
        self.policy = policy or SpanPolicy(tuple(config.span_lengths), dict(config.thresholds))

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: str = "auto",
        dtype: str = "auto",
        span_lengths: tuple[int, ...] | None = None,
        thresholds: dict[int, float] | None = None,
        verification: str = "exact",
    ) -> DSparkBackend:
        """Pool-level options default to what the model's dspark_config.json was tuned with."""
        model = DSparkModel.from_pretrained(path, device=device, dtype=dtype)
        config = model.dspark_config
        policy = SpanPolicy(
            span_lengths=tuple(span_lengths or config.span_lengths),
            thresholds=dict(thresholds or config.thresholds),
            verification=verification,
        )
        return cls(model, policy)

    def _decode(
        self,
        prompt: list[int],
        request: GenerationRequest,
        generator: torch.Generator | None,
        stats: GenerationStats,
        constraint: GrammarConstraint | None,
    ) -> Iterator[list[int]]:
        policy = SpanPolicy.resolve(self.policy, request.dspark, self.model.dspark_config.num_heads)
        return decode(self.model, prompt, request, policy, generator, stats, constraint)

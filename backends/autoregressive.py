"""Plain autoregressive decoding with a KV cache: the standard pool's local backend and DSpark's reference.

prefill runs the whole prompt once; each decode step feeds the one token just chosen. It is the same
computation ``model.generate()`` does, so greedy output matches it token for token. Under a grammar the
logits are masked before the choice, and tokens the grammar forces are committed together in one pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import DynamicCache, PreTrainedModel

from backends.constraints import GrammarConstraint
from backends.loading import load_model
from backends.local import LocalBackend
from backends.sampling import pick_token
from backends.types import GenerationRequest, GenerationStats


def forward(model: PreTrainedModel, tokens: list[int], cache: DynamicCache, device: torch.device):
    """One forward pass over ``tokens`` appended to ``cache``; returns the model output (logits, hidden states)."""
    input_ids = torch.tensor([tokens], dtype=torch.long, device=device)
    return model(input_ids=input_ids, cache=cache, use_cache=True)


class AutoregressiveBackend(LocalBackend):
    name = "autoregressive"

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str = "auto", dtype: str = "auto") -> AutoregressiveBackend:
        return cls(load_model(path, device=device, dtype=dtype))

    def _decode(
        self,
        prompt: list[int],
        request: GenerationRequest,
        generator: torch.Generator | None,
        stats: GenerationStats,
        constraint: GrammarConstraint | None,
    ) -> Iterator[list[int]]:
        model, device = self.loaded.model, self.loaded.device
        cache = DynamicCache(config=model.config)
        logits = forward(model, prompt, cache, device).logits[0, -1]
        stats.forward_passes += 1
        while True:
            tokens = forced_tokens(constraint, stats)
            if not tokens:
                if constraint is not None:
                    constraint.mask_logits(logits)
                tokens = [pick_token(logits, request, generator)]
                if constraint is not None:
                    constraint.consume(tokens)
            yield tokens
            logits = forward(model, tokens, cache, device).logits[0, -1]
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

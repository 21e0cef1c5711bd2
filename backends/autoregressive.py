"""Plain autoregressive decoding with a KV cache: the standard pool's local backend and DSpark's reference.

prefill runs the whole prompt once; each decode step feeds the one token just chosen. It is the same
computation ``model.generate()`` does, so greedy output matches it token for token.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import DynamicCache, PreTrainedModel

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
    ) -> Iterator[list[int]]:
        model, device = self.loaded.model, self.loaded.device
        cache = DynamicCache(config=model.config)
        logits = forward(model, prompt, cache, device).logits[0, -1]
        stats.forward_passes += 1
        while True:
            token = pick_token(logits, request, generator)
            yield [token]
            logits = forward(model, [token], cache, device).logits[0, -1]
            stats.forward_passes += 1

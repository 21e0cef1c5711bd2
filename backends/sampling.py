"""Turn logits into tokens: greedy, or temperature/top-k/top-p sampling from a seeded generator.

One function warps logits for every decoder, so the autoregressive loop, DSpark's drafts and DSpark's
speculative-sampling verifier all sample from exactly the same distribution for a request.
"""

from __future__ import annotations

import torch

from backends.types import GenerationRequest


def make_generator(request: GenerationRequest, device: torch.device) -> torch.Generator | None:
    """A private RNG per request, so the same seed gives the same output whatever runs beside it."""
    if request.greedy:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(request.seed if request.seed is not None else torch.seed())
    return generator


def token_probs(logits: torch.Tensor, request: GenerationRequest) -> torch.Tensor:
    """Probabilities over the last dimension after temperature, top-k and top-p (sampling requests only)."""
    logits = logits.float() / request.temperature
    if request.top_k:
        kth = torch.topk(logits, min(request.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if request.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative - torch.softmax(sorted_logits, dim=-1) >= request.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.softmax(logits, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator).item())


def pick_token(logits: torch.Tensor, request: GenerationRequest, generator: torch.Generator | None) -> int:
    if request.greedy:
        return int(torch.argmax(logits, dim=-1).item())
    return sample(token_probs(logits, request), generator)

"""The sampler every decoder shares: top-p from top-k candidates must equal top-p over the whole sorted
vocabulary, and inverse-CDF draws must follow each row's distribution."""

from __future__ import annotations

import pytest
import torch

from backends.sampling import NUCLEUS_CANDIDATES, NUCLEUS_HEADS, sample, token_probs
from backends.types import GenerationRequest


def _reference_top_p(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Top-p as its definition reads: sort everything, keep tokens whose preceding mass is below top_p."""
    probs = torch.softmax(logits / temperature, dim=-1)
    sorted_probs, order = torch.sort(probs, descending=True, dim=-1)
    keep_sorted = sorted_probs.cumsum(-1) - sorted_probs < top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = probs * keep
    return kept / kept.sum(-1, keepdim=True)


@pytest.mark.parametrize("scale", [8.0, 3.0, 0.05])  # peaked, moderate, nearly flat (nucleus past the candidates)
@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_top_p_matches_the_full_sort(scale, top_p):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 2048, generator=generator) * scale
    request = GenerationRequest(prompt="x", temperature=0.8, top_p=top_p)
    probs = token_probs(logits, request)
    assert torch.allclose(probs, _reference_top_p(logits, 0.8, top_p), atol=1e-6)
    if scale < 1:
        assert ((probs > 0).sum(-1) > NUCLEUS_CANDIDATES).all()


def test_a_pass_of_narrow_and_wide_rows_matches_the_full_sort_row_by_row():
    """DSpark verifies several rows a pass: the rows whose nucleus lies past the candidates look further, the
    others keep what their candidates gave, and every row is its own full-sort nucleus."""
    generator = torch.Generator().manual_seed(4)
    scales = torch.tensor([[8.0], [0.05], [3.0], [0.2]])
    logits = torch.randn(4, 4096, generator=generator) * scales
    probs = token_probs(logits, GenerationRequest(prompt="x", temperature=1.0, top_p=0.9))
    assert torch.allclose(probs, _reference_top_p(logits, 1.0, 0.9), atol=1e-6)
    kept = (probs > 0).sum(-1)
    assert kept[0] < NUCLEUS_CANDIDATES < min(kept[1], kept[3])


def test_a_wide_nucleus_found_among_the_largest_values_is_the_full_sorts():
    """A row whose nucleus lies within its largest 1,024 or 8,192 values takes its floor from those alone, one
    wider from the whole row: each is the full sort's nucleus."""
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 3 * NUCLEUS_HEADS[-1], generator=generator) * torch.tensor([[5.0], [3.0], [1.2]])
    probs = token_probs(logits, GenerationRequest(prompt="x", temperature=1.0, top_p=0.98))
    assert torch.allclose(probs, _reference_top_p(logits, 1.0, 0.98), atol=1e-7)
    kept = (probs > 0).sum(-1).tolist()
    assert NUCLEUS_CANDIDATES < kept[0] <= NUCLEUS_HEADS[0] < kept[1] <= NUCLEUS_HEADS[1] < kept[2], kept


def test_tokens_tied_with_the_nucleus_floor_are_all_kept():
    """Past the candidates the nucleus is every token at or above its smallest kept logit: tokens tied with it
    are kept together, where a sort would keep whichever it happened to order first."""
    logits = torch.zeros(1, 1000)
    logits[0, :10] = 1.0  # ten equal tokens on top, then 990 tied at the floor
    probs = token_probs(logits, GenerationRequest(prompt="x", temperature=1.0, top_p=0.5))
    assert (probs > 0).sum() == 1000


def test_top_k_and_top_p_together():
    logits = torch.randn(2048, generator=torch.Generator().manual_seed(3)) * 2
    probs = token_probs(logits, GenerationRequest(prompt="x", temperature=1.0, top_k=5, top_p=0.9))
    kept = probs > 0
    assert 1 <= kept.sum() <= 5
    assert set(torch.nonzero(kept).flatten().tolist()) <= set(torch.topk(logits, 5).indices.tolist())


def test_sample_draws_each_row_from_its_distribution_and_never_a_zero():
    generator = torch.Generator().manual_seed(1)
    probs = torch.tensor([[0.0, 0.7, 0.0, 0.3], [0.5, 0.0, 0.5, 0.0], [0.0, 0.0, 0.0, 2.0]])
    counts = torch.zeros_like(probs)
    for _ in range(4000):
        counts[torch.arange(3), sample(probs, generator)] += 1
    assert counts[probs == 0].sum() == 0
    assert torch.allclose(counts / 4000, probs / probs.sum(-1, keepdim=True), atol=0.03)

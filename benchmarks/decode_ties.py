"""Why a greedy DSpark output differs from greedy autoregressive decoding, where it does.

In float32 they must agree token for token. In bfloat16 they may not, and not because verification is wrong: a
verifying forward of k tokens adds up its matrix products in another order than k forwards of one token, and
bfloat16 keeps 8 bits of mantissa, so two logits that nearly tie can swap places. For each mismatch this finds the
first differing token and measures, at that position, the margin between the two candidates' logits in both
shapes of forward (the prefix's last token alone after a cached prefix, as a decoding step; the last
:data:`BLOCK` tokens in one forward, as a verification) and how far the two shapes disagree about that margin.
A mismatch is explained when the margin is no larger than that disagreement (or changes sign between shapes):
rounding alone can flip it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from transformers import DynamicCache

from backends.loading import LoadedModel

BLOCK = 8
"""Tokens of the verification-shaped forward: the published drafter's block and its anchor."""


@dataclass
class Tie:
    position: int
    """Index in the answer of the first token that differs."""
    tokens: tuple[int, int]
    """(autoregressive token, DSpark token) there."""
    margin_step: float
    """logit(AR token) - logit(DSpark token), the prefix's last token forwarded alone."""
    margin_block: float
    """The same, the last BLOCK tokens forwarded together."""

    @property
    def rounding(self) -> float:
        return abs(self.margin_step - self.margin_block)

    @property
    def explained(self) -> bool:
        """Rounding of one forward shape against the other covers the margin."""
        return self.margin_step * self.margin_block <= 0 or min(abs(self.margin_step), abs(self.margin_block)) <= (
            self.rounding
        )

    def to_dict(self) -> dict:
        return {**asdict(self), "rounding": self.rounding, "explained": self.explained}


def first_difference(reference: list[int], other: list[int]) -> int | None:
    """The first index where the two differ (a shorter one ends there), None when equal."""
    for i, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


@torch.inference_mode()
def find_tie(loaded: LoadedModel, prompt: list[int], reference: list[int], other: list[int]) -> Tie | None:
    """The margin at the first token where ``other`` leaves ``reference`` (None if they are equal or one merely
    stops first: an end-of-sequence choice is reported by its position, with the end token's logit)."""
    position = first_difference(reference, other)
    if position is None:
        return None
    eos = min(loaded.eos_ids)
    ours = reference[position] if position < len(reference) else eos
    theirs = other[position] if position < len(other) else eos
    ids = torch.tensor([[*prompt, *reference[:position]]], device=loaded.device)
    split = ids.shape[1] - min(BLOCK, ids.shape[1] - 1)
    model = loaded.model
    margins = []
    for cut in (ids.shape[1] - 1, split):
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :cut], past_key_values=cache, use_cache=True)
        logits = model(input_ids=ids[:, cut:], past_key_values=cache, use_cache=True).logits[0, -1].float()
        margins.append(float(logits[ours] - logits[theirs]))
    return Tie(position, (ours, theirs), *margins)

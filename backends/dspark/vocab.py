"""A drafter's output vocabulary: the target's whole vocabulary, or the subset a drafter was trained to propose.

A target's LM head is the largest matrix a drafter touches (SmolLM2-135M: 49,152 x 576, a fifth of the model),
and a drafter runs it over every block position. Most of its rows are tokens a drafter would almost never get
accepted, so a drafter may keep only the most frequent ones (FR-Spec: frequency-ranked draft vocabularies):
its logits are the LM head's rows for those ids, its draws are mapped back to target ids, and its distributions
are widened to the whole vocabulary with zeros elsewhere. Verification is unchanged and stays exact: a token
the drafter cannot propose has draft probability 0, which speculative sampling's residual max(0, p - q) covers.

The subset is the drafter's own (``draft_vocab`` in its weights); the rows are taken from the target at load,
never stored again. Where the target is served from its GGUF blocks, a serving drafter reads those rows in the
GGUF's own 8-bit blocks (:meth:`DraftVocab.serve_from`): a quarter of the float32 copy's bytes, read every round.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backends.packed.linear import PackedLinear
from backends.packed.model import PackedLlama


class DraftVocab:
    def __init__(self, lm_head: nn.Module, ids: torch.Tensor | None) -> None:
        self.lm_head = lm_head
        self.full_size = lm_head.weight.shape[0]
        self.ids = ids
        self.weight = None if ids is None else lm_head.weight.detach()[ids].contiguous()
        self.packed: PackedLinear | None = None

    def serve_from(self, packed: PackedLlama) -> None:
        """Compute logits from the packed engine's blocks of these rows from now on (serving only: training needs
        the float32 rows' gradients)."""
        self.packed = packed.head_rows(self.ids)

    @property
    def size(self) -> int:
        return self.full_size if self.ids is None else self.ids.shape[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., size] logits over the draft vocabulary."""
        if self.packed is not None:
            return self.packed(hidden)
        return self.lm_head(hidden) if self.weight is None else F.linear(hidden, self.weight)

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.ids is None else self.ids[draft_ids]

    def widen(self, probs: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary distributions [..., size] as target-vocabulary ones [..., full_size]."""
        if self.ids is None:
            return probs
        return probs.new_zeros((*probs.shape[:-1], self.full_size)).index_copy_(-1, self.ids, probs)

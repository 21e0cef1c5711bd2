"""Choosing a draft vocabulary (FR-Spec): the target's most frequent answer tokens, sized by what they cover.

A drafter can only propose tokens in its vocabulary, so the subset is ranked by how often the target itself
emits each token in its distilled answers; the coverage of a size (the share of answer tokens inside it) is what
caps a drafter's acceptance, and the LM-head rows it saves are what pays for a smaller one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import torch

from backends.training.distill import Distilled


def frequency_ranked(records: Sequence[Distilled], vocab_size: int, always: Sequence[int] = ()) -> list[int]:
    """Every target id, by how often the target emits it in its answers, then (for ids it never emitted) by how
    often prompts hold it, since answers copy from prompts, then by id; ``always`` (end-of-sequence ids) lead
    whatever their count, since every answer needs them once."""
    answers = Counter(token for record in records for token in record.completion)
    prompts = Counter(token for record in records for token in record.prompt)
    order = sorted(range(vocab_size), key=lambda token: (-answers[token], -prompts[token], token))
    leading = set(always)
    return [*always, *(token for token in order if token not in leading)]


def coverage(records: Iterable[Distilled], ids: Sequence[int]) -> float:
    """The share of answer tokens inside ``ids``."""
    chosen = set(ids)
    total = hit = 0
    for record in records:
        total += len(record.completion)
        hit += sum(token in chosen for token in record.completion)
    return hit / total if total else 0.0


def draft_vocab(ranked: Sequence[int], size: int) -> torch.Tensor:
    """The ``size`` most frequent ids, sorted (a sorted subset keeps the LM head's rows in their order)."""
    return torch.tensor(sorted(ranked[:size]), dtype=torch.long)

"""Blocks copied from the context (n-gram lookup), a drafter that needs no weights.

Agent subtasks copy: an extraction repeats the prompt's values, a rewrite its sentences, a code edit its code.
Where the newest tokens already occurred earlier in the prompt or the answer, the tokens that followed that
occurrence are a strong draft (prompt lookup decoding). The published drafter's loop may propose such a block
instead of the drafter's own (``lookup: beside``), or only such blocks (``lookup: only``); either way it is
verified like any draft. As a draft distribution it is one-hot, so speculative sampling stays exact: the copied
token is accepted with probability p(x), and a rejection draws from p with x removed.

Which block a round verifies is decided before drafting, from each one's measured acceptance in this request
(:class:`MeasuredAcceptance`, one for copies and one for the drafter's blocks; before a position was verified,
a copy's reads as ``PRIOR`` and a draft's as the drafter's own calibrated confidence), so the choice never looks
at the draft it decides about, and a round that copies skips the drafter's pass.
"""

from __future__ import annotations

MAX_NGRAM = 3
PRIOR = 0.7
"""Conditional acceptance of a copied token before this request has verified any (the drafter starts likewise
from its optimistic estimate)."""


class NgramLookup:
    """The request's tokens so far, indexed by every n-gram (n = 1..MAX_NGRAM) at its latest occurrence."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens: list[int] = []
        self.index: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            end = len(self.tokens)
            for n in range(1, min(MAX_NGRAM, end) + 1):
                self.index[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(token)

    def propose(self, anchor: int, limit: int) -> list[int]:
        """Up to ``limit`` tokens that followed the latest earlier occurrence of the longest n-gram ending with
        ``anchor`` (the newest committed token, not yet in the index), or none."""
        history = [*self.tokens[-(MAX_NGRAM - 1) :], anchor] if MAX_NGRAM > 1 else [anchor]
        for n in range(min(MAX_NGRAM, len(history)), 0, -1):
            start = self.index.get(tuple(history[-n:]))
            if start is not None:
                copied = self.tokens[start : start + limit]
                return copied if n > 1 or len(copied) >= 2 else []
        return []


class MeasuredAcceptance:
    """Conditional acceptance by block position of one kind of block this request verified (copies, or the
    drafter's blocks), recent rounds weighted most; a position never verified yet reads as the caller's prior."""

    WEIGHT = 0.5

    def __init__(self) -> None:
        self.conditional: list[float] = []

    def add(self, verified: int, accepted: int, prior: list[float]) -> None:
        """A block of which ``verified`` tokens were verified and the first ``accepted`` survived; ``prior``: the
        estimate a first outcome at a position moves from."""
        for k in range(min(verified, accepted + 1)):
            outcome = 1.0 if k < accepted else 0.0
            if k < len(self.conditional):
                self.conditional[k] += self.WEIGHT * (outcome - self.conditional[k])
            else:
                self.conditional.append(prior[k] + self.WEIGHT * (outcome - prior[k]))

    def confidence(self, prior: list[float]) -> list[float]:
        """Per-position conditional acceptance for a block as long as ``prior`` (``prior`` where none was seen)."""
        return [self.conditional[k] if k < len(self.conditional) else p for k, p in enumerate(prior)]

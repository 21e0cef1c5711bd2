"""Blocks copied from the context (n-gram lookup), a drafter that needs no weights.

Agent subtasks copy: an extraction repeats the prompt's values, a rewrite its sentences, a code edit its code.
Where the newest tokens already occurred earlier in the prompt or the answer, the tokens that followed that
occurrence are a strong draft (prompt lookup decoding). The published drafter's loop may propose such a block
instead of the drafter's own (``lookup: beside``), or only such blocks (``lookup: only``); either way it is
verified like any draft. As a draft distribution it is one-hot, so speculative sampling stays exact: the copied
token is accepted with probability p(x), and a rejection draws from p with x removed.

How far a copy is worth verifying depends on how long the match behind it is. On 800 greedy corpus answers
(``dspark-router bench copies``, every copy verified whole), a copy after a one-token match kept its first token
25% of the time, after 3 tokens 74%, after 8-11 87%, after 32 or more all but never missed; and a copy that is
right so far tends to stay right (a one-token match's later positions 61-85%). So a copy's expected acceptance
is kept by the length of its match and by position (:class:`CopyAcceptance`), learnt from what a pool verified,
and Algorithm 1 verifies as much as that pays on the cost curve. It replaced one per-request estimate for all
copies, which two misses in a row pushed below what one verified token pays, and which nothing then revised: on
a CPU where verifying costs, copies stopped for the rest of the request (bench decode on an Intel Xeon: 1.00-1.19
tokens a forward on the shared prompts, against 1.19-2.52 for transformers' prompt lookup verifying 10 a round).

Which block a round verifies is decided before drafting, from each one's measured acceptance (a copy's by
:class:`CopyAcceptance`, the drafter's blocks by this request's :class:`MeasuredAcceptance`, starting from the
drafter's own calibrated confidence), so the choice never looks at the draft it decides about, and a round that
copies skips the drafter's pass.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

MAX_NGRAM = 4
"""The longest n-gram indexed: a copy starts after the latest earlier occurrence of the longest one that matches."""
LONGEST_MATCH = 32
"""How far back a match is measured beyond ``MAX_NGRAM`` (its length is evidence, not its position)."""
MATCH_CLASSES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
"""Lower bounds of the match lengths kept apart by :class:`CopyAcceptance`: acceptance rises steeply over the
first few, then slowly."""


def match_class(match: int) -> int:
    """The index in ``MATCH_CLASSES`` of the class a match length falls in."""
    return bisect_right(MATCH_CLASSES, match) - 1


@dataclass(frozen=True)
class Copy:
    tokens: list[int]
    match: int
    """How many of the newest tokens (the anchor included) equal those before the copied ones, up to
    ``LONGEST_MATCH``."""


class NgramLookup:
    """The request's tokens so far, indexed by every n-gram (n = 1..MAX_NGRAM) at its latest occurrence."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens: list[int] = []
        self.index: dict[tuple[int, ...], int] = {}
        self.other: dict[tuple[int, ...], int] = {}
        """Per n-gram, the latest occurrence that went on otherwise than the latest one: a token tree's other
        branch (:meth:`alternative`)."""
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            end = len(self.tokens)
            for n in range(1, min(MAX_NGRAM, end) + 1):
                key = tuple(self.tokens[end - n : end])
                before = self.index.get(key)
                if before is not None and self.tokens[before] != token:
                    self.other[key] = before
                self.index[key] = end
            self.tokens.append(token)

    def propose(self, anchor: int, limit: int) -> Copy | None:
        """Up to ``limit`` tokens that followed the latest earlier occurrence of the longest n-gram ending with
        ``anchor`` (the newest committed token, not yet in the index), or none. A copy that runs into the present
        goes on with the anchor and then with itself: the text from the occurrence on repeats with the period the
        match found, as a list, a table's rows or a looping answer does (a loop of two tokens was copied two tokens
        a round, where the whole block repeats it)."""
        return self._copy(self.index, anchor, limit)

    def alternative(self, anchor: int, limit: int) -> Copy | None:
        """The copy after the latest earlier occurrence of the same n-gram that went on otherwise than the one
        :meth:`propose` copies (None where every occurrence went on alike): a token tree's other branch."""
        return self._copy(self.other, anchor, limit)

    def _copy(self, index: dict[tuple[int, ...], int], anchor: int, limit: int) -> Copy | None:
        """The copy after ``index``'s occurrence of the longest n-gram ending with ``anchor`` that occurred before."""
        history = [*self.tokens[-(MAX_NGRAM - 1) :], anchor]
        keys = (tuple(history[-n:]) for n in range(min(MAX_NGRAM, len(history)), 0, -1))
        key = next((key for key in keys if key in self.index), None)
        start = index.get(key)
        if start is None or limit <= 0:
            return None
        return Copy(self._periodic(start, anchor, limit), self._match(start, len(key)))

    def _periodic(self, start: int, anchor: int, limit: int) -> list[int]:
        """``limit`` tokens of the sequence ``tokens + [anchor] + copy`` from ``start`` on (each is one already
        known, since ``start`` is at most the anchor's position)."""
        copy = self.tokens[start : start + limit]
        if len(copy) < limit:
            copy.append(anchor)
            period = len(self.tokens) + 1 - start
            while len(copy) < limit:
                copy.append(copy[len(copy) - period])
        return copy

    def _match(self, start: int, n: int) -> int:
        """The n-gram's match extended backwards: the tokens before its earlier occurrence (which ends at
        ``start``) against those before the anchor."""
        tokens, match = self.tokens, n
        while match < LONGEST_MATCH and match < start and tokens[start - 1 - match] == tokens[len(tokens) - match]:
            match += 1
        return match


class CopyAcceptance:
    """Conditional acceptance of a copied token by the length of the match behind its copy and its position in
    the block, over what one pool verified (greedy and sampled requests apart: a sampled copy survives with the
    target's probability of it, not its argmax).

    Each cell counts its outcomes from a prior of ``PRIOR`` worth ``PRIOR_WEIGHT`` outcomes, and keeps at most
    ``WINDOW`` of them (older ones scaled down), so it follows what this pool's requests copy now. Shared by a
    pool's requests, like its drafter's :class:`~backends.scheduling.DraftCost`: one request rarely sees enough
    copies of each kind to learn them alone, and the match length carries what differs between requests.

    Only a verified copy is evidence, so a kind of copy whose estimate fell below what verifying pays would never
    be tried again: every ``PROBE_AFTER`` copies of a kind in a row that were not verified halve its counts, which
    moves it back towards the prior until one is verified and measured again."""

    PRIOR = 0.7
    PRIOR_WEIGHT = 2.0
    WINDOW = 400.0
    PROBE_AFTER = 32

    def __init__(self) -> None:
        self.kinds: dict[tuple[bool, int], list[list[float]]] = {}
        """(greedy, match class) to each block position's [kept, tried]."""
        self.unverified: dict[tuple[bool, int], int] = {}

    def confidence(self, match: int, length: int, greedy: bool) -> list[float]:
        """Each position's expected conditional acceptance for a copy of ``length`` tokens after a ``match``."""
        cells = self.kinds.get((greedy, match_class(match)), [])
        return [self._estimate(*cells[k]) if k < len(cells) else self.PRIOR for k in range(length)]

    def add(self, match: int, greedy: bool, verified: int, accepted: int) -> None:
        """A copy of which ``verified`` tokens were verified (none: the schedule passed it over) and the first
        ``accepted`` survived."""
        kind = (greedy, match_class(match))
        cells = self.kinds.setdefault(kind, [])
        if not verified:
            self.unverified[kind] = self.unverified.get(kind, 0) + 1
            if self.unverified[kind] >= self.PROBE_AFTER:
                self.unverified[kind] = 0
                for cell in cells:
                    cell[0], cell[1] = cell[0] / 2, cell[1] / 2
            return
        self.unverified[kind] = 0
        for k in range(min(verified, accepted + 1)):
            if k == len(cells):
                cells.append([0.0, 0.0])
            cell = cells[k]
            if cell[1] >= self.WINDOW:
                cell[0], cell[1] = cell[0] * (self.WINDOW - 1) / cell[1], self.WINDOW - 1
            cell[0], cell[1] = cell[0] + (k < accepted), cell[1] + 1

    def _estimate(self, kept: float, tried: float) -> float:
        return (kept + self.PRIOR * self.PRIOR_WEIGHT) / (tried + self.PRIOR_WEIGHT)


class MeasuredAcceptance:
    """Conditional acceptance by block position of the drafter's blocks this request verified, recent rounds
    weighted most; a position never verified yet reads as the caller's prior."""

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

"""What a decode loop asks of the batching engine, and what it gets back.

Every decode loop (plain, span heads, published drafter) is written as the one-request loop it is, as a
generator: where a solo loop would call the model, it yields :class:`Forward` and receives the outputs at its
tokens' positions; where it would crop its KV cache it yields :class:`Rewind`; a list of token ids is what it
commits. The engine (:mod:`backends.engine`) drives many such loops at once and answers all their forwards
with one batched forward pass, so batching never shows in the loops themselves.

The published drafter's loop also yields :class:`Budget` before it drafts and :class:`Schedule` before it
verifies: how many tokens a request may verify depends on the whole batch (the paper's Algorithm 1), which
only the engine sees.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass

import torch

from backends.scheduling import VerifySchedule


@dataclass(frozen=True)
class Forward:
    """Run ``tokens`` through the model after everything this request committed; ``hidden_states`` asks for
    every layer's output as well (the published drafter's injected context)."""

    tokens: list[int]
    hidden_states: bool = False
    parents: list[int] | None = None
    """A token tree (the packed engine's): each token's parent, an index into ``tokens`` (-1: what the request
    committed before), so a token sees only its ancestors; None: a sequence, each token after the one before."""


@dataclass
class ForwardOut:
    hidden: torch.Tensor
    """[n, hidden]: the base model's last hidden state (after its final norm) at each of the n positions."""
    logits: torch.Tensor
    """[n, V]; after a prefill, [1, V]: the prompt's last position's, the only ones a decode loop reads."""
    hidden_states: Sequence[torch.Tensor] | None = None
    """Per layer (embedding output first) [1, n, hidden], when the Forward asked for them."""
    cached: int = 0
    """After a prefill, the prompt's first positions copied from the prefix cache: ``hidden`` holds only the rest's
    (``hidden_states`` every position's)."""


@dataclass(frozen=True)
class Rewind:
    """Forget the last ``tokens`` positions run through the model (the rejected draft)."""

    tokens: int


@dataclass(frozen=True)
class KeepPath:
    """Of the last forward's ``forwarded`` tokens (a tree), keep those at ``kept`` (a path from its first token, in
    order) and forget the rest."""

    forwarded: int
    kept: list[int]


@dataclass(frozen=True)
class Budget:
    """Before drafting: the most draft tokens worth drafting at the batch's size, given the request's mean prefix
    survival so far (``expected``, empty before its first draft); answered with an int, 0 to skip the drafter."""

    schedule: VerifySchedule
    limit: int
    expected: tuple[float, ...] = ()


@dataclass(frozen=True)
class Schedule:
    """After drafting: how many of the draft's tokens to verify, from their confidences; answered with an int."""

    schedule: VerifySchedule
    confidence: list[float]
    limit: int


Step = Forward | Rewind | KeepPath | Budget | Schedule | list[int]
DecodeLoop = Generator[Step, ForwardOut | int | None, None]


class BatchRows:
    """The running batch's requests in row order, each with the positions it has committed: what both engines'
    caches (transformers' :class:`~backends.batch_kv.BatchedKV`, the packed engine's ``PackedKV``) index by."""

    def __init__(self) -> None:
        self.members: list[object] = []
        self.lengths: list[int] = []

    @property
    def rows(self) -> int:
        return len(self.members)

    def __contains__(self, member: object) -> bool:
        return any(m is member for m in self.members)

    def _index(self, member: object) -> int:
        return next(i for i, m in enumerate(self.members) if m is member)

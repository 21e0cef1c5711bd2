"""The running batch on the packed engine: one KV cache per request, one forward for every row's tokens.

The same interface as :class:`backends.batch_kv.BatchedKV` (``prefill``, ``step``, ``rewind``, ``remove``), so the
batching engine drives either. It is simpler because the engine's kernels take ragged batches as they come:
every row's tokens are laid end to end, each with its request's cache and position, so nothing is padded or
masked. A rejected draft is forgotten by moving the request's length back (the next forward writes over its
slots), and a request that leaves takes its cache with it. A request's cache grows by doubling when a forward
would run past it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from itertools import accumulate

import torch

from backends.loading import LoadedModel
from backends.packed.prefix_cache import Hit, JoinedStates, PrefixCache
from backends.steps import BatchRows, ForwardOut

FIRST_ROOM = 256
"""Positions a new request's cache holds past its prompt before it first grows."""


class PackedKV(BatchRows):
    def __init__(self, loaded: LoadedModel, prefixes: PrefixCache | None = None) -> None:
        super().__init__()
        self.model = loaded.packed
        self.caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.prefixes = prefixes

    def prefill(
        self,
        members: list[object],
        prompts: list[list[int]],
        hidden_states: bool = False,
        scopes: list[str | None] | None = None,
    ) -> list[ForwardOut]:
        """Newcomers join as rows, their prompts run in one forward; each row's logits are its prompt's last
        position's only, all a decode loop reads (the LM head is most of a long prompt's cost). A prompt whose start
        the prefix cache holds (for its request's scope in ``scopes``) copies it and runs only the rest, and every
        prompt is kept there for the next."""
        first, scopes = self.rows, scopes or [None] * len(prompts)
        hits = [self._start_from_cache(scope, prompt, hidden_states) for scope, prompt in zip(scopes, prompts)]
        for member, prompt, hit in zip(members, prompts, hits):
            self.members.append(member)
            self.lengths.append(0 if hit is None else hit.shared)
            self.caches.append(self.model.new_cache(len(prompt) + FIRST_ROOM))
            if hit is not None:
                self.model.copy_positions(hit.prefix.cache, self.caches[-1], hit.shared)
        rows = list(range(first, self.rows))
        rest = [prompt[self.lengths[r] :] for r, prompt in zip(rows, prompts)]
        outputs = self._forward(rows, rest, hidden_states, last_logits=True)
        for i, (r, scope, prompt, hit) in enumerate(zip(rows, scopes, prompts, hits)):
            if hit is not None:
                outputs[i] = self._joined(outputs[i], hit)
            states = outputs[i].hidden_states
            if self.prefixes is not None and self.prefixes.keeps(scope, prompt, states is not None):
                copy = self.model.grown_cache(self.caches[r], len(prompt), len(prompt))
                self.prefixes.add(scope, prompt, copy, states)
        return outputs

    def _start_from_cache(self, scope: str | None, prompt: list[int], hidden_states: bool) -> Hit | None:
        return None if self.prefixes is None else self.prefixes.longest(scope, prompt, hidden_states)

    @staticmethod
    def _joined(out: ForwardOut, hit: Hit) -> ForwardOut:
        """A prefill's output from the prompt's first position: the cached prefix's states joined to the rest's."""
        states = out.hidden_states
        if states is not None:
            states = JoinedStates(hit.prefix.states or {}, hit.shared, states)
        return replace(out, hidden_states=states, cached=hit.shared)

    def step(
        self, inputs: list[list[int]], hidden_states: bool = False, trees: list[list[int] | None] | None = None
    ) -> list[ForwardOut]:
        """One forward over every row, row r fed ``inputs[r]`` (at least one token each), as a token tree where
        ``trees[r]`` gives each token's parent (:class:`~backends.steps.Forward`)."""
        if len(inputs) != self.rows:
            raise ValueError(f"{len(inputs)} inputs for {self.rows} rows")
        return self._forward(list(range(self.rows)), inputs, hidden_states, trees=trees)

    def rewind(self, member: object, tokens: int) -> None:
        """Forget the last ``tokens`` positions of ``member``'s row (its rejected draft)."""
        if tokens > 0:
            self.lengths[self._index(member)] -= tokens

    def keep(self, member: object, forwarded: int, kept: list[int]) -> None:
        """Of the last forward's ``forwarded`` tokens (a tree's, each at the slot of its index), keep the path
        ``kept`` at the positions it stands for and forget the rest; a kept token written past its position moves
        there."""
        r = self._index(member)
        start = self.lengths[r] - forwarded
        moved = [(start + index, start + depth) for depth, index in enumerate(kept) if index != depth]
        if moved:
            slots, positions = zip(*moved)
            self.model.move_positions(self.caches[r], list(slots), list(positions))
        self.lengths[r] = start + len(kept)

    def remove(self, member: object) -> None:
        r = self._index(member)
        del self.members[r], self.lengths[r], self.caches[r]

    def _forward(
        self,
        rows: list[int],
        inputs: list[list[int]],
        hidden_states: bool,
        last_logits: bool = False,
        trees: list[list[int] | None] | None = None,
    ) -> list[ForwardOut]:
        """The forward's inputs are built as Python lists and made tensors once each: a decoding step feeds a token
        or a few a row, and every torch op here costs a few microseconds more than the list it replaces. A tree's
        token is written at the slot of its index and stands at the position of its depth."""
        counts = [len(tokens) for tokens in inputs]
        for r, n in zip(rows, counts):
            self._reserve(r, self.lengths[r] + n)
        seq = [r for r, n in zip(rows, counts) for _ in range(n)]
        ends = list(accumulate(counts))
        trees = trees or [None] * len(rows)
        depths = [_depths(parents) if parents is not None else range(n) for parents, n in zip(trees, counts)]
        positions = [self.lengths[r] + d for r, row in zip(rows, depths) for d in row]
        tree = None
        if any(parents is not None for parents in trees):
            slots = [p for r, n in zip(rows, counts) for p in range(self.lengths[r], self.lengths[r] + n)]
            parents = [
                -1 if up < 0 else end - n + up
                for row, n, end in zip(trees, counts, ends)
                for up in (row if row is not None else range(-1, n - 1))
            ]
            tree = torch.tensor(slots), torch.tensor(parents)
        hidden, logits, states = self.model.forward(
            torch.tensor([t for row in inputs for t in row]),
            torch.tensor(seq),
            torch.tensor(positions),
            self.caches,
            hidden_states,
            torch.tensor([end - 1 for end in ends]) if last_logits else None,
            tree,
        )
        results = []
        for i, (r, n, end) in enumerate(zip(rows, counts, ends)):
            self.lengths[r] += n
            start = end - n
            layers = LayerRows(states, start, end) if states is not None else None
            row_logits = logits[i : i + 1] if last_logits else logits[start:end]
            results.append(ForwardOut(hidden[start:end], row_logits, layers))
        return results

    def _reserve(self, r: int, positions: int) -> None:
        room = self.model.capacity(self.caches[r])
        if positions > room:
            self.caches[r] = self.model.grown_cache(self.caches[r], self.lengths[r], max(positions, 2 * room))


def _depths(parents: list[int]) -> list[int]:
    """Each tree token's depth below what its request committed before (its parent's plus one)."""
    depths: list[int] = []
    for up in parents:
        depths.append(0 if up < 0 else depths[up] + 1)
    return depths


class LayerRows(Sequence):
    """One row's positions of every layer's states ([layers + 1, T, hidden] for the whole batch), each layer sliced
    only when read, as ``[1, n, hidden]``: a drafter reads a few of the 31 layers, and slicing all of them cost a
    step some 150 us."""

    def __init__(self, states: torch.Tensor, start: int, end: int) -> None:
        self._states, self._start, self._end = states, start, end

    def __len__(self) -> int:
        return self._states.shape[0]

    def __getitem__(self, layer):
        if isinstance(layer, slice):
            return tuple(self[i] for i in range(*layer.indices(len(self))))
        return self._states[layer, self._start : self._end].unsqueeze(0)

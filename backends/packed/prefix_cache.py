"""Prompt prefixes already run: an agent's requests share a template, so a prefill starts where the last one agreed.

An agent sends one system prompt, schema or tool with different contents, over and over; on the trace of
``bench trace`` 22-138 tokens of a 40-177-token prompt repeat the request before, and a prefill on a 2-core CPU
costs about a step per dozen tokens, so the shared part was most of a short answer's time. Every prefilled prompt
is kept here (its keys and values, and the hidden states of the layers a drafter reads), and a newcomer whose
prompt starts with at least :data:`MIN_SHARED` of a kept one's tokens copies that prefix's cache and runs only
the rest (vLLM's automatic prefix caching and SGLang's radix cache do this by blocks; our caches are one tensor a
request, so a copy of the prefix is all it takes).

The kernels compute each position from the cache the same way whether its prefix was run in this forward or an
earlier one, so a cached prefix changes no logit (a test holds greedy output and the prompt's last logits equal).

Kept per scope, like the traffic caches: a prefill's time tells whether its prompt's start was cached, so one
tenant must never start from another's prompt. Bounded by bytes; the least recently used prompt goes first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

MIN_SHARED = 16
"""The shortest prefix worth copying: below it a prefill saves less than the copy and the lookup cost."""


@dataclass(frozen=True)
class Prefix:
    """A kept prompt: its tokens, a cache (keys, values) of its positions and (where its prefill asked for them) the
    states of the kept layers, [n, hidden] each."""

    tokens: tuple[int, ...]
    cache: tuple[torch.Tensor, torch.Tensor]
    states: dict[int, torch.Tensor] | None

    @property
    def nbytes(self) -> int:
        tensors = [*self.cache, *(self.states or {}).values()]
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class Hit:
    prefix: Prefix
    shared: int
    """Positions copied: the prompts' common start, short of the newcomer's last token (its logits are needed)."""


class PrefixCache:
    """One engine's kept prompts by scope, least recently used first; ``state_layers``: the hidden-state layers
    (embedding output 0) a prompt's prefill keeps, those its decode loop reads (the published drafter's)."""

    def __init__(self, max_bytes: int, state_layers: Sequence[int] = ()) -> None:
        self.max_bytes = max_bytes
        self.state_layers = tuple(state_layers)
        self._prefixes: OrderedDict[tuple[str | None, tuple[int, ...]], Prefix] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._prefixes)

    def longest(self, scope: str | None, prompt: list[int], states: bool) -> Hit | None:
        """The kept prompt of ``scope`` sharing the longest start with ``prompt`` (at least :data:`MIN_SHARED`
        tokens); with ``states``, only one kept with the layers' states."""
        best: Hit | None = None
        for (kept_scope, tokens), prefix in self._prefixes.items():
            if kept_scope != scope or (states and prefix.states is None):
                continue
            shared = common_start(tokens, prompt, len(prompt) - 1)
            if shared >= MIN_SHARED and (best is None or shared > best.shared):
                best = Hit(prefix, shared)
        if best is not None:
            self._prefixes.move_to_end((scope, best.prefix.tokens))
        return best

    def keeps(self, scope: str | None, prompt: list[int], states: bool) -> bool:
        """Whether :meth:`add` would keep this prompt: one long enough to share and not kept yet (or kept without
        the states its prefill now brings)."""
        known = self._prefixes.get((scope, tuple(prompt)))
        return len(prompt) > MIN_SHARED and (known is None or (states and known.states is None))

    def add(
        self,
        scope: str | None,
        prompt: list[int],
        cache: tuple[torch.Tensor, torch.Tensor],
        states: Sequence[torch.Tensor] | None,
    ) -> None:
        """Keep a prefilled prompt that :meth:`keeps` wants: ``cache``, a copy of its positions, and from
        ``states`` (per layer, [1, n, hidden]) copies of the kept layers'. One larger than the whole cache is not
        kept."""
        key = (scope, tuple(prompt))
        kept = None if states is None else {layer: states[layer][0].clone() for layer in self.state_layers}
        prefix = Prefix(key[1], cache, kept)
        if prefix.nbytes > self.max_bytes:
            return
        known = self._prefixes.pop(key, None)  # kept without the states this prefill brings
        self.nbytes += prefix.nbytes - (known.nbytes if known is not None else 0)
        self._prefixes[key] = prefix
        while self.nbytes > self.max_bytes:
            _, evicted = self._prefixes.popitem(last=False)
            self.nbytes -= evicted.nbytes


def common_start(a: Sequence[int], b: Sequence[int], limit: int | None = None) -> int:
    """How many leading tokens ``a`` and ``b`` share (at most ``limit``)."""
    n = min(len(a), len(b), len(a) if limit is None else limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class JoinedStates(Sequence):
    """A prompt's per-layer states when its start came from the cache: the kept layers' prefix states before the
    rows this prefill ran, ``[1, n, hidden]`` each as :class:`~backends.packed.kv.LayerRows` gives them. A layer
    the cache did not keep has no prefix to join: reading it is a bug in whoever set ``state_layers``."""

    def __init__(self, prefix: dict[int, torch.Tensor], shared: int, rows: Sequence[torch.Tensor]) -> None:
        self._prefix, self._shared, self._rows = prefix, shared, rows

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, layer):
        if isinstance(layer, slice):
            return tuple(self[i] for i in range(*layer.indices(len(self))))
        layer = layer % len(self)
        if layer not in self._prefix:
            raise KeyError(f"layer {layer}'s states were not kept with the cached prompt prefix")
        return torch.cat([self._prefix[layer][: self._shared].unsqueeze(0), self._rows[layer]], dim=1)

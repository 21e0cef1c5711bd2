"""Turn logits into tokens: greedy, or temperature/top-k/top-p sampling from a seeded generator.

One function warps logits for every decoder, so the autoregressive loop, DSpark's drafts and DSpark's
speculative-sampling verifier all sample from exactly the same distribution for a request.

Both steps are written for a decode step's budget of a few milliseconds. Top-p needs the most likely tokens in
order, and sorting 49,152 logits with their indices costs ~2 ms a row on a 2-core EPYC. The nucleus mostly lies
within the top few dozen tokens, so the candidates come from ``topk``, and only a row whose candidates hold less
than ``top_p`` of the mass (at temperature 0.9 and top_p 0.95 on the default model, about a quarter of the rows
of prose) looks further, by its values sorted alone: a pass of 8 such rows takes 10 ms where sorting them with
their indices took 22, and the rows of a pass whose candidates suffice are not sorted at all (DSpark samples
and verifies several rows a pass, and on such prose three of four of its passes had one row that looked
further), among its largest values first (:func:`_cpu_floor`). Drawing is inverse-CDF (one uniform, a cumulative
sum, a binary search), ~5x cheaper than ``torch.multinomial`` and the same distribution.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from backends.types import GenerationRequest

if TYPE_CHECKING:
    from backends.constraints import GrammarConstraint

NUCLEUS_CANDIDATES = 64
NUCLEUS_HEADS = (1024, 8192)
"""The largest values a wide row's nucleus floor is looked for among, in turn, before the whole row is sorted."""


def make_generator(request: GenerationRequest, device: torch.device) -> torch.Generator | None:
    """A private RNG per request, so the same seed gives the same output whatever runs beside it."""
    if request.greedy:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(request.seed if request.seed is not None else torch.seed())
    return generator


def _top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """``logits`` with every token outside the nucleus at -inf: the nucleus is the most likely tokens up to and
    including the one that brings their mass to ``top_p``. Its candidates come from ``topk``; only the rows whose
    candidates hold less than ``top_p`` find their smallest kept logit among all (:func:`_nucleus_floor`)."""
    log_total = torch.logsumexp(logits, dim=-1, keepdim=True)
    values, order = torch.topk(logits, min(NUCLEUS_CANDIDATES, logits.shape[-1]), dim=-1)
    probs = torch.exp(values - log_total)
    keep = probs.cumsum(dim=-1) - probs < top_p
    nucleus = torch.full_like(logits, float("-inf")).scatter(-1, order, values.masked_fill(~keep, float("-inf")))
    wide = probs.sum(dim=-1) < top_p
    if values.shape[-1] < logits.shape[-1] and bool(wide.any()):
        rows = logits[wide]
        floor = _nucleus_floor(rows, log_total[wide], top_p)
        nucleus[wide] = rows.masked_fill(rows < floor, float("-inf"))
    return nucleus


def _nucleus_floor(logits: torch.Tensor, log_total: torch.Tensor, top_p: float) -> torch.Tensor:
    """Per row, the smallest logit of the nucleus, from the row's values sorted alone. Tokens tied with the floor
    are all kept, where a sort would have kept whichever it happened to order first."""
    if logits.device.type != "cpu":
        return _floor_of(torch.sort(logits, descending=True, dim=-1).values, log_total, top_p)
    return torch.cat([_cpu_floor(row.numpy(), total, top_p) for row, total in zip(logits, log_total)])


def _cpu_floor(row: np.ndarray, log_total: torch.Tensor, top_p: float) -> torch.Tensor:
    """One row's floor on a CPU, from its largest values only where they hold ``top_p`` of the mass: NumPy
    selects the top 1,024 of 49,152 logits and sorts them in 0.3 ms, against 1 ms to sort the whole row without
    indices (itself a fifth of ``torch.sort``'s cost), and at temperature 1 and top_p 0.98 two rows in three of
    the default model's prose need no more. Their descending prefix is the sorted row's, so the floor is too."""
    for head in NUCLEUS_HEADS:
        if head >= len(row):
            break
        values = torch.from_numpy(np.sort(np.partition(row, len(row) - head)[-head:])[::-1].copy())
        if float(torch.exp(values - log_total).sum()) >= top_p:
            return _floor_of(values[None], log_total[None], top_p)
    return _floor_of(torch.from_numpy(np.sort(row)[::-1].copy())[None], log_total[None], top_p)


def _floor_of(values: torch.Tensor, log_total: torch.Tensor, top_p: float) -> torch.Tensor:
    """The smallest kept value of rows sorted in descending order that hold at least ``top_p`` of the mass."""
    probs = torch.exp(values - log_total)
    kept = (probs.cumsum(dim=-1) - probs < top_p).sum(dim=-1, keepdim=True)
    return values.gather(-1, kept - 1)


def token_probs(logits: torch.Tensor, request: GenerationRequest) -> torch.Tensor:
    """Probabilities over the last dimension after temperature, top-k and top-p (sampling requests only)."""
    logits = logits.float() / request.temperature
    if request.top_k:
        kth = torch.topk(logits, min(request.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if request.top_p < 1.0:
        logits = _top_p(logits, request.top_p)
    return torch.softmax(logits, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token id per row of ``probs`` (shape ``probs.shape[:-1]``), drawn by inverse CDF. Rows need not sum to
    one. The cumulative sum is float64, so a token of tiny probability keeps its share even in a large vocabulary,
    and a token of probability zero is never drawn."""
    cdf = probs.double().cumsum(dim=-1)
    u = torch.rand((*probs.shape[:-1], 1), generator=generator, device=probs.device, dtype=torch.float64)
    index = torch.searchsorted(cdf, u * cdf[..., -1:], right=True)[..., 0]
    past_end = index == probs.shape[-1]
    if bool(past_end.any()):  # u * total rounded up to total: the draw belongs to the last token with any mass
        index[past_end] = probs.shape[-1] - 1 - torch.argmax((probs[past_end].flip(-1) > 0).to(torch.int8), dim=-1)
    return index


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's argmax: the first index of its largest value, as ``torch.argmax`` gives it, read from ``max``'s
    indices, which on a CPU cost a third as much (a row of 49,152 logits: 21 against 65 us on a 2-core Xeon, and a
    DSpark pool picks one for every verified position of every row)."""
    return logits.max(dim=-1).indices.tolist()


def pick_token(logits: torch.Tensor, request: GenerationRequest, generator: torch.Generator | None) -> int:
    """The next token from one position's logits ``[V]``."""
    if request.greedy:
        return greedy_tokens(logits.view(1, -1))[0]
    return int(sample(token_probs(logits, request), generator).item())


def pick_allowed(
    logits: torch.Tensor,
    request: GenerationRequest,
    generator: torch.Generator | None,
    constraint: GrammarConstraint | None,
) -> int:
    """:func:`pick_token` among what ``constraint`` allows now (``logits`` untouched when greedy: the grammar's
    bits are read for the argmax alone, :meth:`~backends.constraints.engine.GrammarConstraint.greedy`)."""
    if constraint is None:
        return pick_token(logits, request, generator)
    if request.greedy:
        return constraint.greedy(logits.view(1, -1), [])[0]
    return pick_token(constraint.mask_logits(logits), request, generator)

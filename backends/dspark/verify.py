"""Verification, shared by both DSpark loops (span heads and the published drafter): which drafted tokens the
target keeps, the token after them, and the statistics of each round.

``exact`` verification keeps greedy output identical to plain decoding (the longest prefix equal to the target's
argmax) and sampled output equal in distribution (speculative sampling: accept x with probability min(1, p/q),
resample from max(0, p - q) at the first rejection, draw a bonus token when all survive). ``confidence`` keeps
the whole draft unverified. Under a grammar a token the grammar refuses is never the target's choice: greedy
takes each position's argmax among the allowed tokens, and sampling masks the logits first, so such a token has
p = 0 and is rejected like any other. Text the grammar forces is kept unchecked wherever it stands in a draft
(``forced``), as plain decoding commits it without asking the model.
"""

from __future__ import annotations

from typing import Literal

import torch

from backends.constraints import GrammarConstraint
from backends.sampling import greedy_tokens, sample, token_probs
from backends.types import GenerationRequest, GenerationStats, SpanStats

Source = Literal["drafter", "copy", "traffic", "datastore"]
"""Where a round's block came from: the drafter, the request's context, the pool's earlier answers, or the target's
shipped answers."""


def masked_by_grammar(logits: torch.Tensor, draft: list[int], constraint: GrammarConstraint | None) -> torch.Tensor:
    """The verifying pass's logits [len(draft) + 1, V] with what the grammar refuses at each position set to -inf."""
    if constraint is None:
        return logits
    return logits.masked_fill(~constraint.span_masks(draft).to(logits.device), -torch.inf)


def verify(
    draft: list[int],
    draft_probs: torch.Tensor | None,
    logits: torch.Tensor,
    request: GenerationRequest,
    verification: str,
    generator: torch.Generator | None,
    refused_probs: torch.Tensor | None = None,
    constraint: GrammarConstraint | None = None,
    forced: list[bool] | None = None,
) -> tuple[int, int | None]:
    """Accepted draft tokens and the token after them (None, unverified: the next round picks it from the logits at
    the last kept position). ``logits`` [len(draft) + 1, V] are the verifying pass's, before ``constraint``'s
    masks (the grammar's state before the draft); ``draft_probs`` [m, V] the distributions the draft's first m
    tokens were drawn from (the rest, and all of them with None, certain: a looked-up block, forced text);
    ``refused_probs`` that of one more drafted token the grammar refused (see :func:`verify_sampled`); ``forced``
    flags the draft's tokens the grammar forces, kept whatever the model says."""
    if verification == "confidence":
        return len(draft), None
    if request.greedy:
        return verify_greedy(draft, logits, constraint, forced)
    target_probs = token_probs(masked_by_grammar(logits, draft, constraint), request)
    return verify_sampled(draft, draft_probs, target_probs, generator, refused_probs, forced)


def verify_greedy(
    draft: list[int],
    target_logits: torch.Tensor,
    constraint: GrammarConstraint | None = None,
    forced: list[bool] | None = None,
) -> tuple[int, int]:
    """How many draft tokens equal the base model's argmax at their position (under the grammar) or are forced
    there, and its argmax after them: the correction, or with every token kept, the bonus."""
    rows = target_logits[: len(draft) + 1]
    targets = constraint.greedy(rows, draft, forced) if constraint is not None else greedy_tokens(rows)
    forced = forced or [False] * len(draft)
    accepted = 0
    while accepted < len(draft) and (forced[accepted] or draft[accepted] == targets[accepted]):
        accepted += 1
    return accepted, targets[accepted]


def verify_sampled(
    draft: list[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
    refused_probs: torch.Tensor | None = None,
    forced: list[bool] | None = None,
) -> tuple[int, int]:
    """Speculative sampling: accept d with probability min(1, p(d)/q(d)); on rejection resample from
    max(0, p - q), so every committed token is distributed exactly as plain sampling from p would be.

    ``target_probs`` has a row per draft token plus one for the position after the whole draft. Returns the
    accepted count and the token that follows them: the correction, or with every draft token accepted, the
    bonus token sampled from that last row, so the next round needs no sampling of its own. Every position's
    uniform is drawn at once: the draws are independent, so those past the first rejection are simply unused,
    and the test is one vectorised comparison instead of a Python loop over scalars. ``refused_probs`` stands for
    one more drafted token after the draft that the grammar refused: certainly rejected (p = 0), so what follows
    the draft is drawn from max(0, p - q) with its q, as for any rejection, not from p; that keeps output exact.
    ``draft_probs`` covers the first m draft tokens; the rest, and all with None, were certain under their draft
    (q = 1: a block copied from the context or the traffic, forced text), where building one-hot rows of the
    vocabulary's width cost a sampled round 2% of its time; a certain token the grammar refused needs no
    ``refused_probs``, since max(0, p - q) is p where p is 0. A ``forced`` token is kept unchecked: plain sampling
    commits the grammar's forced text without drawing it."""

    def after_draft() -> int:
        if refused_probs is not None:
            return draw_residual(target_probs[len(draft)], refused_probs, generator)
        return int(sample(target_probs[len(draft)], generator))

    if not draft:
        return 0, after_draft()
    positions = torch.arange(len(draft), device=target_probs.device)
    tokens = torch.tensor(draft, dtype=torch.long, device=target_probs.device)
    p = target_probs[positions, tokens]
    q = torch.ones_like(p)
    drawn = 0 if draft_probs is None else len(draft_probs)
    if drawn:
        q[:drawn] = draft_probs[positions[:drawn], tokens[:drawn]]
    u = torch.rand(len(draft), generator=generator, device=target_probs.device)
    rejected = (q <= 0) | (u * q > p)
    if forced is not None:
        rejected &= ~torch.tensor(forced, device=rejected.device)
    rejected = rejected.tolist()
    if True not in rejected:
        return len(draft), after_draft()
    i = rejected.index(True)
    return i, draw_residual(target_probs[i], draft_probs[i] if i < drawn else draft[i], generator)


def draw_residual(target: torch.Tensor, draft: torch.Tensor | int, generator: torch.Generator | None) -> int:
    """The token after a rejected draft token: drawn from max(0, p - q), or from p where q covers it all. A draft
    ``int`` is a token drafted with certainty (a looked-up block's): max(0, p - q) is p without it."""
    if isinstance(draft, int):
        residual = target.clone()
        residual[draft] = 0.0
    else:
        residual = torch.clamp(target - draft, min=0.0)
    return int(sample(residual if residual.sum() > 0 else target, generator))


class RoundStats:
    """A request's rounds as :class:`~backends.types.SpanStats` counts them: what each round proposed, what the
    target kept at each draft position, and (when the loop closes) the means the router and benchmarks read."""

    def __init__(self, stats: GenerationStats, width: int) -> None:
        self.spans = stats.spans = SpanStats(
            acceptance_by_offset=[0.0] * width, reached_by_offset=[0] * width, accepted_by_offset=[0] * width
        )
        self._verified_at = [0] * width

    def verified(self, drafted: int, accepted: int, source: Source = "drafter", tree: bool = False) -> None:
        """One round: ``drafted`` tokens verified after the anchor, ``accepted`` of them kept (by position up to the
        drafter's width; a traffic draft may run longer), the block from ``source``; of a ``tree``, its longest
        branch and the branch kept, ``source`` the block that branch came from."""
        spans = self.spans
        for offset in range(min(drafted, len(self._verified_at))):
            self._verified_at[offset] += 1
            spans.accepted_by_offset[offset] += offset < accepted
            spans.reached_by_offset[offset] += offset <= accepted
        spans.steps += 1
        spans.fallback_steps += drafted == 0
        spans.copied_rounds += source == "copy"
        spans.traffic_rounds += source == "traffic"
        spans.datastore_rounds += source == "datastore"
        spans.tree_rounds += tree
        spans.proposed_span_hist[1 + drafted] = spans.proposed_span_hist.get(1 + drafted, 0) + 1
        spans.accepted_span_hist[1 + accepted] = spans.accepted_span_hist.get(1 + accepted, 0) + 1

    def close(self) -> None:
        spans = self.spans
        committed = sum(n * count for n, count in spans.accepted_span_hist.items())
        spans.mean_accepted = committed / spans.steps if spans.steps else 0.0
        spans.acceptance_by_offset = [a / v if v else 0.0 for a, v in zip(spans.accepted_by_offset, self._verified_at)]

"""The DSpark decode loop: prefill, propose a span, verify it in the pass that proposes the next one.

Each step starts from the base model's logits and last hidden state at the newest committed position:

1. ``propose``: the base model's own next token (certain) plus a draft from the span heads, cut to the
   length the span policy picks from the heads' confidence;
2. one forward pass over that proposal appends it to the KV cache and yields, at every proposal position,
   the base model's logits (to verify the draft) and the hidden state (to draft the next step);
3. ``verify_greedy`` / ``verify_sampled`` keep the longest prefix the base model agrees with; ``exact``
   verification makes greedy output identical to plain decoding and sampled output equal in distribution
   (speculative sampling, the heads' distributions as the draft); ``confidence`` keeps the whole span.
   A sampled verification also draws the token after the kept prefix (the correction, or the bonus token
   when the whole draft survived) from the same pass's distributions, so the next step samples only its draft;
4. rejected positions are rewound out of the KV cache and the next step starts from the last kept one.

Under a grammar (``constraint``), text the grammar forces is committed in one pass without drafting, the
draft is cut at the first token the grammar rejects, and verification compares against grammar-masked
logits, so every committed token is valid; the grammar only ever consumes committed tokens, so a rejected
draft needs no grammar rollback.

Every pass commits at least one token, so the loop never does worse than plain decoding in token count.
The loop is one request's; the engine batches it with the others' (:mod:`backends.steps`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backends.autoregressive import forced_tokens
from backends.constraints import GrammarConstraint
from backends.dspark.model import DSparkModel
from backends.dspark.selection import SpanPolicy
from backends.sampling import pick_token, sample, token_probs
from backends.steps import DecodeLoop, Forward, Rewind
from backends.types import GenerationRequest, GenerationStats, SpanStats


@dataclass
class Proposal:
    tokens: list[int]
    draft_probs: torch.Tensor | None
    """Draft distributions [len(tokens) - 1, V] (sampling only): what verification compares against."""
    refused_probs: torch.Tensor | None = None
    """Sampling under a grammar: the draft distribution of the token the grammar refused right after the kept
    draft. That token was drafted and is certainly rejected (p = 0), so what follows the draft is drawn from
    max(0, p - q) with this q, as for any rejection, not from p: that keeps sampled output exact."""


def propose(
    model: DSparkModel,
    hidden: torch.Tensor,
    logits: torch.Tensor,
    first: int | None,
    request: GenerationRequest,
    policy: SpanPolicy,
    generator: torch.Generator | None,
    stats: SpanStats,
    constraint: GrammarConstraint | None,
) -> Proposal:
    """The base model's next token (or the one verification already sampled) and a confident draft after it.

    Under a grammar the first token is chosen from masked logits and committed to the grammar at once (it is
    kept whatever verification says), and the draft is cut at the first token the grammar rejects.
    """
    if first is None:
        if constraint is not None:
            constraint.mask_logits(logits)
        first = pick_token(logits, request, generator)
    if constraint is not None:
        constraint.consume([first])
    token = first
    if policy.longest == 1:
        stats.proposed_span_hist[1] = stats.proposed_span_hist.get(1, 0) + 1
        return Proposal([token], None)
    head_logits = model.heads(hidden)[: policy.longest - 1]
    vocab = model.heads.vocab
    if request.greedy:
        top_probs, draft = torch.softmax(head_logits.float(), dim=-1).max(dim=-1)
        draft_probs = None
    else:
        probs = token_probs(head_logits, request)
        draft = sample(probs, generator)
        top_probs = probs.max(dim=-1).values
        draft_probs = vocab.widen(probs)
    draft = vocab.target_ids(draft)
    length, cleared = policy.choose(top_probs)
    for n in cleared:
        stats.cleared_threshold[n] = stats.cleared_threshold.get(n, 0) + 1
    stats.fallback_steps += length == 1
    stats.proposed_span_hist[length] = stats.proposed_span_hist.get(length, 0) + 1
    drafted = draft[: length - 1].tolist()
    valid = constraint.valid_prefix(drafted) if constraint is not None else len(drafted)
    if draft_probs is None:
        return Proposal([token, *drafted[:valid]], None)
    refused = draft_probs[valid] if valid < len(drafted) else None
    return Proposal([token, *drafted[:valid]], draft_probs[:valid], refused)


def verify_greedy(draft: list[int], target_logits: torch.Tensor) -> int:
    """How many draft tokens equal the base model's argmax at their position."""
    targets = torch.argmax(target_logits[: len(draft)], dim=-1).tolist()
    accepted = 0
    while accepted < len(draft) and draft[accepted] == targets[accepted]:
        accepted += 1
    return accepted


def verify_sampled(
    draft: list[int],
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
    refused_probs: torch.Tensor | None = None,
) -> tuple[int, int]:
    """Speculative sampling: accept d with probability min(1, p(d)/q(d)); on rejection resample from
    max(0, p - q), so every committed token is distributed exactly as plain sampling from p would be.

    ``target_probs`` has a row per draft token plus one for the position after the whole draft. Returns the
    accepted count and the token that follows them: the correction, or with every draft token accepted, the
    bonus token sampled from that last row, so the next step needs no sampling of its own. Every position's
    uniform is drawn at once: the draws are independent, so those past the first rejection are simply unused,
    and the test is one vectorised comparison instead of a Python loop over scalars. ``refused_probs`` (see
    :class:`Proposal`) stands for one more drafted token, certainly rejected, after the draft."""

    def after_draft() -> int:
        if refused_probs is not None:
            return draw_residual(target_probs[len(draft)], refused_probs, generator)
        return int(sample(target_probs[len(draft)], generator))

    if not draft:
        return 0, after_draft()
    positions = torch.arange(len(draft), device=target_probs.device)
    tokens = torch.tensor(draft, dtype=torch.long, device=target_probs.device)
    p, q = target_probs[positions, tokens], draft_probs[positions, tokens]
    u = torch.rand(len(draft), generator=generator, device=target_probs.device)
    rejected = ((q <= 0) | (u * q > p)).tolist()
    if True not in rejected:
        return len(draft), after_draft()
    i = rejected.index(True)
    return i, draw_residual(target_probs[i], draft_probs[i], generator)


def draw_residual(target: torch.Tensor, draft: torch.Tensor, generator: torch.Generator | None) -> int:
    """The token after a rejected draft token: drawn from max(0, p - q), or from p where q covers it all."""
    residual = torch.clamp(target - draft, min=0.0)
    return int(sample(residual if residual.sum() > 0 else target, generator))


def decode(
    model: DSparkModel,
    prompt: list[int],
    request: GenerationRequest,
    policy: SpanPolicy,
    generator: torch.Generator | None,
    stats: GenerationStats,
    constraint: GrammarConstraint | None = None,
) -> DecodeLoop:
    """Yield the tokens each forward pass commits; the engine closes the loop when output ends."""
    width = policy.longest - 1
    spans = stats.spans = SpanStats(
        acceptance_by_offset=[0.0] * width, reached_by_offset=[0] * width, accepted_by_offset=[0] * width
    )
    proposed_at, accepted_at = [0] * width, spans.accepted_by_offset
    out = yield Forward(prompt)
    hidden, logits = out.hidden[-1], out.logits[-1]
    stats.forward_passes += 1
    next_token: int | None = None
    try:
        while True:
            forced = forced_tokens(constraint, stats)
            if forced:
                out = yield Forward(forced)
                stats.forward_passes += 1
                hidden, logits, next_token = out.hidden[-1], out.logits[-1], None
                yield forced
                continue
            proposal = propose(model, hidden, logits, next_token, request, policy, generator, spans, constraint)
            out = yield Forward(proposal.tokens)
            all_hidden, all_logits = out.hidden, out.logits
            stats.forward_passes += 1
            draft = proposal.tokens[1:]
            if constraint is not None:
                masks = constraint.span_masks(draft).to(all_logits.device)
                all_logits = all_logits.masked_fill(~masks, float("-inf"))
            if policy.verification == "confidence":
                accepted, next_token = len(draft), None
            elif request.greedy:
                accepted, next_token = verify_greedy(draft, all_logits), None
            else:
                target_probs = token_probs(all_logits, request)
                accepted, next_token = verify_sampled(
                    draft, proposal.draft_probs, target_probs, generator, proposal.refused_probs
                )
            for offset in range(len(draft)):
                proposed_at[offset] += 1
                accepted_at[offset] += offset < accepted
                spans.reached_by_offset[offset] += offset <= accepted
            if len(draft) > accepted:
                yield Rewind(len(draft) - accepted)
            if constraint is not None:
                constraint.consume(draft[:accepted])
            committed = proposal.tokens[: 1 + accepted]
            spans.steps += 1
            spans.accepted_span_hist[len(committed)] = spans.accepted_span_hist.get(len(committed), 0) + 1
            hidden, logits = all_hidden[accepted], all_logits[accepted]
            yield committed
    finally:
        committed_total = sum(n * count for n, count in spans.accepted_span_hist.items())
        spans.mean_accepted = committed_total / spans.steps if spans.steps else 0.0
        spans.acceptance_by_offset = [a / p if p else 0.0 for a, p in zip(accepted_at, proposed_at)]

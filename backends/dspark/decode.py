"""The DSpark decode loop: prefill, propose a span, verify it in the pass that proposes the next one.

Each step starts from the base model's logits and last hidden state at the newest committed position:

1. ``propose``: the base model's own next token (certain) plus a draft from the span heads, cut to the
   length the span policy picks from the heads' confidence;
2. one forward pass over that proposal appends it to the KV cache and yields, at every proposal position,
   the base model's logits (to verify the draft) and the hidden state (to draft the next step);
3. :mod:`backends.dspark.verify` keeps the longest prefix the base model agrees with; ``exact`` verification
   makes greedy output identical to plain decoding and sampled output equal in distribution (speculative
   sampling, the heads' distributions as the draft); ``confidence`` keeps the whole span. Exact verification
   also gives the token after the kept prefix (the correction, or the bonus token when the whole draft
   survived) from the same pass's logits, so the next step picks only its draft;
4. rejected positions are rewound out of the KV cache and the next step starts from the last kept one.

Under a grammar (``constraint``), text the grammar forces is committed in one pass without drafting, the
draft is cut at the first token the grammar rejects (forced text within and after it kept unchecked, as plain
decoding commits it), and verification compares against grammar-masked
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
from backends.dspark.verify import RoundStats, verify
from backends.sampling import pick_allowed, sample, token_probs
from backends.steps import DecodeLoop, Forward, Rewind
from backends.types import GenerationRequest, GenerationStats


@dataclass
class Proposal:
    tokens: list[int]
    draft_probs: torch.Tensor | None
    """Draft distributions [m, V] of the first m draft tokens (sampling only): what verification compares against;
    the tokens after them are forced text."""
    refused_probs: torch.Tensor | None = None
    """Sampling under a grammar: the draft distribution of the token the grammar refused right after the kept
    draft. That token was drafted and is certainly rejected (p = 0), so what follows the draft is drawn from
    max(0, p - q) with this q, as for any rejection, not from p: that keeps sampled output exact."""
    forced: list[bool] | None = None
    """Under a grammar, per draft token: text the grammar forces there (:meth:`GrammarConstraint.follow`)."""


def propose(
    model: DSparkModel,
    hidden: torch.Tensor,
    logits: torch.Tensor,
    first: int | None,
    request: GenerationRequest,
    policy: SpanPolicy,
    generator: torch.Generator | None,
    rounds: RoundStats,
    constraint: GrammarConstraint | None,
    room: int,
) -> Proposal:
    """The base model's next token (or the one verification already sampled) and a confident draft after it, at
    most ``room`` tokens in all (what ``max_tokens`` leaves: nothing is drafted past it).

    Under a grammar the first token is chosen from masked logits and committed to the grammar at once (it is
    kept whatever verification says), and the draft is walked through the grammar: cut at the first token it
    rejects, its forced text in the draft's place and after it (:meth:`GrammarConstraint.follow`).
    """
    if first is None:
        first = pick_allowed(logits, request, generator, constraint)
    if constraint is not None:
        constraint.consume([first])
    token = first
    if policy.longest == 1 or room <= 1:
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
        rounds.spans.cleared_threshold[n] = rounds.spans.cleared_threshold.get(n, 0) + 1
    drafted = draft[: min(length, room) - 1].tolist()
    if constraint is None:
        return Proposal([token, *drafted], draft_probs)
    walk = constraint.follow(drafted, room - 1)
    probs, refused = walk.rows(draft_probs) if draft_probs is not None else (None, None)
    return Proposal([token, *walk.tokens], probs, refused, walk.forced)


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
    rounds = RoundStats(stats, policy.longest - 1)
    out = yield Forward(prompt)
    hidden, logits = out.hidden[-1], out.logits[-1]
    stats.forward_passes += 1
    next_token: int | None = None
    produced = 0
    try:
        while True:
            forced = forced_tokens(constraint, stats)
            if forced:
                out = yield Forward(forced)
                stats.forward_passes += 1
                hidden, logits, next_token = out.hidden[-1], out.logits[-1], None
                produced += len(forced)
                yield forced
                continue
            room = request.max_tokens - produced
            proposal = propose(model, hidden, logits, next_token, request, policy, generator, rounds, constraint, room)
            out = yield Forward(proposal.tokens)
            stats.forward_passes += 1
            draft = proposal.tokens[1:]
            accepted, next_token = verify(
                draft,
                proposal.draft_probs,
                out.logits,
                request,
                policy.verification,
                generator,
                proposal.refused_probs,
                constraint,
                proposal.forced,
            )
            rounds.verified(len(draft), accepted)
            if proposal.forced:
                stats.forced_tokens += sum(proposal.forced[:accepted])
            if len(draft) > accepted:
                yield Rewind(len(draft) - accepted)
            if constraint is not None:
                constraint.consume(draft[:accepted])
            hidden, logits = out.hidden[accepted], out.logits[accepted]
            produced += 1 + accepted
            yield proposal.tokens[: 1 + accepted]
    finally:
        rounds.close()

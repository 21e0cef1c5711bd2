"""Decoding with the published DSpark drafter: prefill, draft, schedule, verify, commit.

A round starts from the anchor, the newest committed token not yet run through the target (the bonus or
correction token of the previous round, or the target's own next token):

1. ``draft``: the drafter's context cache takes the target features of the tokens committed since the last round;
   one backbone pass over [anchor, mask, ...] gives gamma hidden states, and the Markov head samples the block
   left to right, each token from its own exact distribution softmax(U_k + B(x_{k-1})) (warped by the request's
   temperature/top-k/top-p, so it is the distribution verification divides by); the confidence head gives c_k;
   With ``lookup`` on, a block copied from the context (:mod:`backends.dspark.lookup`: the tokens that followed
   the latest earlier occurrence of the newest n-gram) may stand in for the drafter's block, chosen before
   drafting from what copies after a match as long have earned in the pool and drafts in this request so far; a
   round that copies skips the drafter's pass, and its block, certain under it (q = 1), is verified like any other;
2. ``schedule``: the verification length, by Algorithm 1 from prefix survival and the profiled SPS curve (or a
   static threshold). Under a grammar the block is walked through the grammar first (``obeying``): cut at the first
   token the grammar refuses, the grammar's forced text in the block's place where it is forced and after it,
   weighed as certain once what precedes it is kept; so no verified position is spent on a token the grammar
   refuses.
   Algorithm 1 weighs every request in the batch at once, so the loop asks the engine twice: before drafting,
   how many tokens could be worth drafting at this batch size, weighed against the drafter pass's own cost and
   the request's mean prefix survival so far (``Budget``: none under heavy load, and the drafter is skipped),
   and after, how many to verify (``Schedule``);
3. ``verify``: one target forward over [anchor, draft...] appends them to the target's KV cache and yields the
   target's logits and features there. Greedy keeps the longest prefix equal to the target's argmax; sampling
   accepts x_k with probability min(1, p/q), resamples from max(0, p - q) at the first rejection, and draws a
   bonus token when all survive. A token the grammar refused counts as rejected there (its p is 0), so the token
   in its place is also drawn from max(0, p - q): cutting it off unverified would change the distribution;
4. ``commit``: rejected positions are rewound out of the target cache, the grammar consumes what was kept, and the
   kept positions' features wait for the next round's draft.

Text the grammar forces is committed at once and starts the round's forward in the anchor's place: a block looked
up after it (a key's value copied from the prompt, the rest of a template from the traffic) is verified in the same
pass. (Only a looked-up block: the drafter's context has no features yet for the forced tokens before the last.)
Forced text within or after a round's block rides in the block's own forward (``obeying``), kept unchecked as plain
decoding keeps it.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass, field, replace
from itertools import pairwise

import torch

from backends.autoregressive import forced_tokens
from backends.constraints import GrammarConstraint
from backends.dspark.datastore import Datastore
from backends.dspark.drafter import ContextCache, DSparkDrafter, target_features
from backends.dspark.lookup import CopyAcceptance, MeasuredAcceptance, NgramLookup
from backends.dspark.traffic import MAX_DRAFT, TrafficCache, TrafficCaches
from backends.dspark.tree import ANCHOR, Branch, TokenTree, merged, verify_tree
from backends.dspark.verify import RoundStats, Source, verify
from backends.loading import LoadedModel
from backends.packed.prefix_cache import common_start
from backends.sampling import pick_allowed, sample, token_probs
from backends.scheduling import DraftCost, VerifySchedule, prefix_survival
from backends.steps import Budget, DecodeLoop, Forward, ForwardOut, KeepPath, Rewind, Schedule, Step
from backends.traffic_settings import TrafficOptions
from backends.types import GenerationRequest, GenerationStats

TREE_WORK_S = 2e-4
"""What a tree round's own work (merging its blocks, walking the verified tree) costs before this request measured
it: on a 2-core Xeon a tree of 10 nodes from 3 blocks took 0.08 ms to merge and cut and 0.04 ms to verify greedily,
and under a grammar each block's walk adds 7 us a token."""


@dataclass
class TargetPass:
    logits: torch.Tensor
    """[n, V] at each of the pass's positions."""
    features: torch.Tensor
    """[n, context_width]: the drafter's injected context for those positions."""


@dataclass
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None
    """[gamma, V] the distributions the tokens were drawn from (sampling only)."""
    confidence: list[float]


class RecentSurvival:
    """A request's prefix survival a_k by block position over its recent rounds: what drafting is expected to
    earn next round, known before the draft is made (the budget must not look at the draft it decides).

    Recent rounds weigh most (each round halves the weight of those before it), because how predictable a text
    is changes within it: a copied span follows free prose. And a request whose drafts stopped paying is
    probed again after ``PROBE_AFTER`` rounds without a draft, budgeted as at its start; otherwise the estimate
    that stopped the drafting could never be revised, since only a draft updates it. A probe that does not
    reopen drafting doubles the wait for the next (up to ``LONGEST_WAIT``): where a drafter pass costs about a
    step, as on a 2-core CPU, a probe every 9th round of a request the drafter cannot help cost about a tenth
    of its time (the hybrid at temperature 0.8 ran at 0.86x copies alone)."""

    WEIGHT = 0.5
    PROBE_AFTER = 8
    LONGEST_WAIT = 64

    def __init__(self) -> None:
        self.survival: list[float] = []
        self.skipped = 0
        self.wait = self.PROBE_AFTER

    def add(self, confidence: list[float]) -> None:
        for k, a in enumerate(prefix_survival(confidence)):
            if k < len(self.survival):
                self.survival[k] += self.WEIGHT * (a - self.survival[k])
            else:
                self.survival.append(a)

    def expected(self) -> tuple[float, ...]:
        """Positions drafted before; the budget takes later ones as certain (the optimistic start), and all of
        them on a probe."""
        return () if self.skipped >= self.wait else tuple(self.survival)

    def drafted(self, limit: int) -> None:
        """The budget's answer this round: a probe that drafted waits twice as long for the next, and a draft
        the measured survival paid for (the probe reopened drafting) brings the wait back to ``PROBE_AFTER``."""
        if not limit:
            self.skipped += 1
            return
        probed = self.skipped >= self.wait
        self.wait = min(2 * self.wait, self.LONGEST_WAIT) if probed else self.PROBE_AFTER
        self.skipped = 0

    def conditional(self, length: int) -> list[float]:
        """The drafter's own estimate of each position's acceptance given the ones before (a_k / a_{k-1}), 1 where
        it has not drafted that far: the prior its measured acceptance starts from."""
        survival = [1.0, *self.survival]
        ratios = [a / before if before > 0 else 1.0 for before, a in pairwise(survival)]
        return [*ratios, *[1.0] * length][:length]


def target_pass(out: ForwardOut, layer_ids: list[int]) -> TargetPass:
    return TargetPass(out.logits, target_features(out.hidden_states, layer_ids)[0])


def draft(
    drafter: DSparkDrafter,
    context: ContextCache,
    anchor: int,
    request: GenerationRequest,
    generator: torch.Generator | None,
    length: int,
) -> Draft:
    """The first ``length`` tokens of the block (a request's cap makes sampling the rest wasted work)."""
    hidden = drafter.draft_hidden(context, anchor)[:length]
    tokens, rows = sample_block(drafter, drafter.base_logits(hidden), anchor, request, generator)
    confidence: list[float] = []
    if drafter.confidence_head is not None and tokens:
        prev_ids = torch.tensor([anchor, *tokens[:-1]], device=hidden.device)
        confidence = torch.sigmoid(drafter.confidence_logits(hidden, prev_ids)).tolist()
    return Draft(tokens, torch.stack(rows) if rows else None, confidence)


def sample_block(
    drafter: DSparkDrafter,
    base: torch.Tensor,
    anchor: int,
    request: GenerationRequest,
    generator: torch.Generator | None,
) -> tuple[list[int], list[torch.Tensor]]:
    """The Markov head's sequential stage: each block position's token from U_k + B(previous token), left to
    right from the anchor, with (sampling only) the distribution it was drawn from over the whole vocabulary."""
    vocab = drafter.vocab
    if request.greedy:
        return drafter.markov_head.greedy(base, anchor, vocab), []
    tokens: list[int] = []
    rows: list[torch.Tensor] = []
    token = anchor
    for row in base:
        probs = token_probs(drafter.markov_head.step(row, token).float(), request)
        rows.append(vocab.widen(probs))
        token = int(vocab.target_ids(sample(probs, generator)))
        tokens.append(token)
    return tokens, rows


def expected_rate(schedule: VerifySchedule, confidence: list[float], drafting_s: float = 0.0) -> float:
    """A block's expected tokens per second from its conditional acceptance by position: the anchor and the
    expected prefix it keeps, over the verifying forward plus ``drafting_s`` of drafting (the drafter's pass; a copy
    or a traffic draft is looked up). Without a cost curve, tokens per round."""
    expected = 1.0 + sum(prefix_survival(confidence))
    if schedule.sps is None:
        return expected
    return expected / (1.0 / schedule.sps.at(1 + len(confidence)) + drafting_s)


@dataclass
class Proposal:
    """What a round verifies after its anchor."""

    tokens: list[int]
    probs: torch.Tensor | None = None
    """[m, V] the distributions the drafter drew the first m tokens from (sampling only); the tokens after them, and
    all of a looked-up block's (None), are certain under their draft."""
    refused: torch.Tensor | None = None
    """The distribution of the drafted token the grammar refused right after the draft's own tokens (see
    :func:`~backends.dspark.verify.verify_sampled`)."""
    match: int | None = None
    """A looked-up block's match length (:class:`~backends.dspark.lookup.Copy`, a traffic draft); None for the
    drafter's."""
    source: Source = "drafter"
    forced: list[bool] | None = None
    """Per token, under a grammar: text the grammar forces there, kept unchecked as plain decoding keeps it."""
    own: int | None = None
    """Under a grammar, the leading tokens that are the block's own (the rest is forced text after it)."""
    cut_short: bool = False
    """The grammar stopped the block before the length the schedule chose: its next token was refused, or forced
    text took its place. The target could never have written it, so what a block of this kind earns counts it
    rejected (or a block the grammar always cuts would be drafted every round and never learnt from)."""

    def confidence(self, estimate: list[float]) -> list[float]:
        """Each token's expected conditional acceptance, from ``estimate`` (the block's, by its own positions):
        forced text is certain once what precedes it is kept."""
        if not estimate or self.forced is None:  # no estimate (no confidence head): verified whole, as ungrammared
            return estimate
        return [1.0 if certain else estimate[k] for k, certain in enumerate(self.forced)]

    @property
    def owned(self) -> int:
        """How many leading tokens are the block's own (all of them, where no grammar walked it)."""
        return len(self.tokens) if self.own is None else self.own

    def first(self, length: int) -> Proposal:
        """The schedule's cut of a block walked through the grammar: its first ``length`` tokens, and at least the
        forced text it starts with (certain after the anchor, which is committed)."""
        forced = self.forced or []
        leading = next((k for k, certain in enumerate(forced) if not certain), len(forced))
        length = max(length, leading)
        own = self.owned
        whole = length >= len(self.tokens)
        return replace(
            self,
            tokens=self.tokens[:length],
            probs=None if self.probs is None else self.probs[: min(own, length)],
            refused=self.refused if whole else None,
            forced=None if self.forced is None else self.forced[:length],
            own=None if self.own is None else min(own, length),
            cut_short=self.cut_short and length >= own,
        )

    def learnt(self, accepted: int) -> tuple[int, int]:
        """The block's own tokens tried and kept this round, for what blocks of its kind are measured to earn."""
        own = self.owned
        return own + int(self.cut_short and accepted >= own), min(accepted, own)


def obeying(proposal: Proposal, constraint: GrammarConstraint | None, room: int) -> Proposal:
    """The block as the grammar lets it stand (:meth:`~backends.constraints.GrammarConstraint.follow`): cut at a
    token the grammar refuses, forced text in the place of the block's where it is forced, and the forced text
    where the block stops appended, all within ``room``. A forced token costs the forward a position but is
    certain once the block before it is kept, and the round's last token is then the target's own (a bonus),
    where a round ending at forced text would have thrown it away."""
    if constraint is None:
        return proposal
    walk = constraint.follow(proposal.tokens, room)
    probs, refused = walk.rows(proposal.probs) if proposal.probs is not None else (None, None)
    short = walk.drafted < len(proposal.tokens)
    kept = {"tokens": walk.tokens, "probs": probs, "refused": refused, "forced": walk.forced, "own": walk.drafted}
    return replace(proposal, **kept, cut_short=short)


@dataclass
class Traffic:
    """Drafting from a pool's earlier answers (:mod:`backends.dspark.traffic`): the pool's caches and the request's
    scope among them, what traffic drafts earned in the pool by the length of their match, and the request's options
    (``enabled`` off: its answer still joins the cache, and it drafts from nothing there); beside them the target's
    shipped answers (:mod:`backends.dspark.datastore`, where the pool reads them) and what their drafts earned."""

    caches: TrafficCaches
    scope: str | None
    acceptance: CopyAcceptance
    options: TrafficOptions
    datastore: Datastore | None = None
    stored: CopyAcceptance = field(default_factory=CopyAcceptance)

    @property
    def cache(self) -> TrafficCache:
        return self.caches.for_scope(self.scope)


class Drafting:
    """One request's drafting state across rounds: the drafter's context cache and the target features it has not
    taken in yet, its recent prefix survival and the acceptance its blocks earned, the copies the context offers
    with what copies earned in the pool, and the pool's traffic."""

    def __init__(
        self, drafter: DSparkDrafter, prompt: list[int], copies: CopyAcceptance, traffic: Traffic | None = None
    ) -> None:
        self.drafter = drafter
        self.context = drafter.new_context()
        self.pending: list[torch.Tensor] = []
        self.survival = RecentSurvival()
        self.lookup = NgramLookup(prompt)
        self.copies, self.drafts = copies, MeasuredAcceptance()
        self.traffic = traffic
        self.prompt_length = len(prompt)
        self.tree_cost = DraftCost(TREE_WORK_S)

    def draft_confidence(self, limit: int) -> list[float]:
        """A draft of ``limit``'s expected conditional acceptance by position: the drafter's measured acceptance
        where its blocks were verified, its calibrated confidence elsewhere."""
        return self.drafts.confidence(self.survival.conditional(limit))

    def earned(self, source: Source) -> CopyAcceptance:
        """What looked-up blocks from ``source`` earned in the pool, by the length of their match."""
        if source == "copy" or self.traffic is None:
            return self.copies
        return self.traffic.acceptance if source == "traffic" else self.traffic.stored

    @property
    def committed(self) -> int:
        return self.context.length + sum(features.shape[0] for features in self.pending)


def chosen(schedule: VerifySchedule, blocks: list[LookedUp], drafting: list[float]) -> LookedUp | None:
    """The looked-up block expected to commit the most tokens per second, where it beats drafting (whose
    ``drafting`` acceptance is weighed over the forward plus the drafter's pass); under ``lookup: only`` the best
    block whatever drafting would do; None: draft."""
    best = max(blocks, key=lambda block: expected_rate(schedule, block.confidence), default=None)
    if best is None or schedule.lookup == "only":
        return best
    beats = expected_rate(schedule, best.confidence) >= expected_rate(schedule, drafting, schedule.draft_s)
    return best if beats else None


@dataclass(frozen=True)
class LookedUp:
    """A block a round may verify without the drafter's pass: copied from the request's context, or drafted from the
    pool's earlier answers; with its expected conditional acceptance by position, learnt in the pool by the length
    of the match behind it."""

    tokens: list[int]
    confidence: list[float]
    match: int
    source: Source
    fork: bool = False
    """Another path where the looked-up text went on otherwise (a traffic draft's runner-up,
    :attr:`~backends.dspark.traffic.TrafficDraft.forks`, or the copy after an earlier occurrence,
    :meth:`~backends.dspark.lookup.NgramLookup.alternative`): a tree's branch only, never verified alone, and what
    it earns is not learnt (its runner-up token would count against the blocks of its kind)."""


def looked_up(
    state: Drafting,
    schedule: VerifySchedule,
    anchor: int,
    limit: int,
    traffic_limit: int,
    greedy: bool,
    forks: bool = False,
) -> list[LookedUp]:
    """The blocks this round could copy: from the context (``lookup`` on) and from the traffic (where the pool has
    it on), each up to its own limit; with ``forks``, the other paths too (a traffic draft's, and the copy after
    the latest occurrence that went on otherwise)."""
    blocks = []
    copies = [state.lookup.propose(anchor, limit)] if schedule.lookup != "off" else []
    if copies and copies[0] and forks:
        copies.append(state.lookup.alternative(anchor, limit))
    for copy in filter(None, copies):
        confidence = state.copies.confidence(copy.match, len(copy.tokens), greedy)
        blocks.append(LookedUp(copy.tokens, confidence, copy.match, "copy", copy is not copies[0]))
    traffic = state.traffic
    if traffic is not None and traffic.options.enabled:
        context = [*state.lookup.tokens[-traffic.options.depth :], anchor]
        sources = [(traffic.cache, traffic.acceptance, "traffic")]
        if traffic.datastore is not None:
            sources.append((traffic.datastore, traffic.stored, "datastore"))
        for store, learnt, source in sources:
            found = store.speculate(context, traffic_limit, traffic.options, forks)
            if found is None:
                continue
            for draft in [found, *found.forks] if forks else [found]:
                confidence = draft.confidence(learnt.confidence(draft.match, len(draft.tokens), greedy))
                blocks.append(LookedUp(draft.tokens, confidence, draft.match, source, draft is not found))
    return blocks


@dataclass(frozen=True)
class TreeProposal:
    """What a round verifies after its anchor as a token tree (:mod:`backends.dspark.tree`): the looked-up blocks
    merged, and the blocks themselves, so each kind learns what its own tokens earned."""

    tree: TokenTree
    blocks: list[LookedUp]
    built_s: float
    """Seconds spent merging the blocks (what the round's own tree work costs, with its verification's)."""


def as_tree(
    blocks: list[LookedUp], best: LookedUp, constraint: GrammarConstraint | None, room: int
) -> TokenTree | None:
    """The looked-up blocks merged into a tree, ``best``'s first, where they disagree somewhere (None where they
    are all one branch: the best block alone is verified, as without trees). Under a grammar each block is cut
    where the grammar refuses it or forces other text (:meth:`~backends.constraints.GrammarConstraint.follow`),
    and its forced tokens are certain once what precedes them is kept."""
    if len(blocks) < 2:
        return None
    branches = []
    for block in [best, *(block for block in blocks if block is not best)]:
        if constraint is None:
            branches.append(Branch(block.tokens, block.confidence))
            continue
        walk = constraint.follow(block.tokens, room)
        own = common_start(walk.tokens, block.tokens)
        forced = walk.forced[:own]
        confidence = [1.0 if certain else c for c, certain in zip(block.confidence, forced)]
        branches.append(Branch(block.tokens[:own], confidence, forced))
    tree = merged(branches)
    return None if all(parent == node - 1 for node, parent in enumerate(tree.parents)) else tree


def tree_pays(schedule: VerifySchedule, tree: list[float], block: list[float], overhead_s: float) -> bool:
    """Whether the tree (its nodes' conditional acceptance best first) is expected to commit more tokens per second
    than the best block alone, each at the length Algorithm 1 gives it alone, the tree's own work (``overhead_s``,
    measured) weighed like a drafter pass: on a CPU, where every verified token costs, a tree whose other branches
    are unlikely loses to the block it was built around."""
    if schedule.sps is None:
        return True
    at_tree, at_block = schedule.length(tree, len(tree)), schedule.length(block, len(block))
    return expected_rate(schedule, tree[:at_tree], overhead_s) > expected_rate(schedule, block[:at_block])


def propose(
    state: Drafting,
    schedule: VerifySchedule,
    anchor: int,
    limit: int,
    traffic_limit: int,
    request: GenerationRequest,
    generator: torch.Generator | None,
    cost: DraftCost,
    constraint: GrammarConstraint | None,
    room: int,
    drafts: bool = True,
    trees: bool = False,
) -> Generator[Step, int, Proposal | TreeProposal]:
    """Whichever block is expected to commit the most tokens per second (:func:`expected_rate`): one looked up (a
    copy from the context, up to ``limit`` tokens as the drafter's, or a draft from the traffic, up to
    ``traffic_limit``) or the drafter's (unless ``drafts`` is off); its length asked of the engine (``Budget`` before
    drafting, ``Schedule`` after). A drafter pass is weighed at what passes have measured in the loop (``cost``), and
    this one's time joins them. Every estimate predates this round's blocks, so a request no copy and no earlier
    answer can help drafts as it did without them. With ``trees`` on, looked-up blocks that disagree are verified
    together as a tree where that is expected to pay (:func:`tree_pays`), its size asked of the engine as a block's
    length is (its nodes best first, :meth:`~backends.dspark.tree.TokenTree.best_first`)."""
    schedule = replace(schedule, draft_s=cost.seconds)
    blocks = looked_up(state, schedule, anchor, limit, traffic_limit, request.greedy, forks=trees)
    drafting = state.draft_confidence(limit) if drafts else []
    best = chosen(schedule, [block for block in blocks if not block.fork], drafting)
    started = time.perf_counter()
    tree = as_tree(blocks, best, constraint, room) if best and trees else None
    confidence = tree.best_first() if tree is not None else []
    if tree is not None and tree_pays(schedule, confidence, best.confidence, state.tree_cost.seconds):
        built_s = time.perf_counter() - started
        budget = yield Budget(replace(schedule, draft_s=0.0), len(tree), tuple(prefix_survival(confidence)))
        count = (yield Schedule(schedule, confidence, budget)) if budget else 0
        return TreeProposal(tree.first(count), blocks, built_s) if count else Proposal([])
    if best:
        expected = tuple(prefix_survival(best.confidence))
        budget = yield Budget(replace(schedule, draft_s=0.0), len(best.tokens), expected)
        block = obeying(Proposal(best.tokens, match=best.match, source=best.source), constraint, room)
        confidence, appended = block.confidence(best.confidence), max(0, len(block.tokens) - len(best.tokens))
        return block.first((yield Schedule(schedule, confidence, budget + appended)) if budget else 0)
    if schedule.lookup == "only" or not drafts:
        return obeying(Proposal([]), constraint, room)
    # None expected (optimistic) on a probe, so a request whose drafts stopped paying is tried again
    expected = tuple(prefix_survival(drafting)) if state.survival.expected() else ()
    limit = yield Budget(schedule, limit, expected)
    state.survival.drafted(limit)
    if not limit:  # the drafter is skipped, and its context catches up on the next round that drafts
        return obeying(Proposal([]), constraint, room)
    started = time.perf_counter()
    state.drafter.extend_context(state.context, torch.cat(state.pending))
    state.pending = []
    block = draft(state.drafter, state.context, anchor, request, generator, limit)
    cost.add(time.perf_counter() - started)
    state.survival.add(block.confidence)
    walked = obeying(Proposal(block.tokens, block.probs), constraint, room)
    appended = max(0, len(walked.tokens) - len(block.tokens))
    return walked.first((yield Schedule(schedule, walked.confidence(block.confidence), limit + appended)))


def verify_tree_round(
    proposal: TreeProposal,
    run: list[int],
    state: Drafting,
    request: GenerationRequest,
    generator: torch.Generator | None,
    rounds: RoundStats,
    layer_ids: list[int],
    constraint: GrammarConstraint | None,
    stats: GenerationStats,
) -> Generator[Step, ForwardOut | None, tuple[list[int], torch.Tensor, int]]:
    """One forward over the round's committed ``run`` and its tree; the tokens kept (a branch's leading ones, which
    the grammar consumes), the logits after them and the token after them. The kept branch is moved into place in
    the cache, and each block of the tree learns what its own tokens earned."""
    tree, before = proposal.tree, len(run)
    parents = [*range(-1, before - 1), *(before - 1 if up == ANCHOR else before + up for up in tree.parents)]
    step = target_pass((yield Forward([*run, *tree.tokens], hidden_states=True, parents=parents)), layer_ids)
    step_logits = step.logits[before - 1 :]
    probs = None if request.greedy else token_probs(step_logits, request)
    started = time.perf_counter()
    path, next_token = verify_tree(tree, step_logits, probs, generator, constraint)
    state.tree_cost.add(proposal.built_s + time.perf_counter() - started)
    kept = [tree.tokens[node] for node in path]
    if constraint is not None:
        constraint.consume(kept)
        stats.forced_tokens += sum(tree.forced[node] for node in path)
    for block in (block for block in proposal.blocks if not block.fork):
        tried = tree.reach(block.tokens)
        state.earned(block.source).add(block.match, request.greedy, tried, common_start(block.tokens, kept, tried))
    source = next((block.source for block in proposal.blocks if block.tokens[: len(kept)] == kept), "copy")
    rounds.verified(tree.depth, len(kept), source, tree=True)
    rows = [*range(before), *(before + node for node in path)]
    yield KeepPath(before + len(tree), rows)
    state.pending.append(step.features[rows])
    return kept, step_logits[path[-1] + 1 if path else 0], next_token


def decode(
    loaded: LoadedModel,
    drafter: DSparkDrafter,
    prompt: list[int],
    request: GenerationRequest,
    schedule: VerifySchedule,
    generator: torch.Generator | None,
    stats: GenerationStats,
    constraint: GrammarConstraint | None = None,
    cost: DraftCost | None = None,
    copies: CopyAcceptance | None = None,
    traffic: Traffic | None = None,
) -> DecodeLoop:
    """Yield the tokens each target pass commits; the engine closes the loop when output ends. ``cost``: the
    pool's measured drafter pass, and ``copies``: what the pool's copied blocks earned, both of which this
    request's rounds update (by default this request's own, starting from ``schedule.draft_s`` and the prior);
    ``traffic``: the pool's earlier answers to draft from, which this request's answer joins when it ends."""
    cost = cost or DraftCost(schedule.draft_s)
    layer_ids = drafter.config.target_layer_ids
    # a tree needs the packed engine's tree attention and exact verification; under a grammar, greedy's (the
    # grammar's masks along each branch), since a sampled request's looked-up blocks are its context's copies alone
    trees = schedule.trees and loaded.packed is not None and schedule.verification == "exact"
    trees = trees and (constraint is None or request.greedy)
    rounds = RoundStats(stats, drafter.block_size)
    state = Drafting(drafter, prompt, copies or CopyAcceptance(), traffic)
    step = target_pass((yield Forward(prompt, hidden_states=True)), layer_ids)
    stats.forward_passes += 1
    state.pending.append(step.features)
    logits, next_token, produced = step.logits[-1], None, 0
    try:
        while True:
            # the tokens this round's forward starts with, committed already: the grammar's forced text (whose
            # logits no round needs, so a looked-up block rides along after it), else the anchor
            run = forced_tokens(constraint, stats)
            if run:
                next_token = None
            else:
                anchor = next_token
                if anchor is None:
                    anchor = pick_allowed(logits, request, generator, constraint)
                if constraint is not None:
                    constraint.consume([anchor])
                run = [anchor]
            anchor = run[-1]
            state.lookup.extend(run[:-1])
            context_room = MAX_DRAFT + 1 if loaded.max_context is None else loaded.max_context - state.committed
            room = max(0, min(context_room - len(run), request.max_tokens - produced - len(run)))
            limit, traffic_limit = min(schedule.limit(drafter.block_size), room), min(schedule.limit(MAX_DRAFT), room)
            # the drafter's context has no features for forced tokens before the anchor: only a lookup after them
            proposal = yield from propose(
                state,
                schedule,
                anchor,
                limit,
                traffic_limit,
                request,
                generator,
                cost,
                constraint,
                room,
                drafts=len(run) == 1,
                trees=trees,
            )
            if isinstance(proposal, TreeProposal):
                kept, logits, next_token = yield from verify_tree_round(
                    proposal, run, state, request, generator, rounds, layer_ids, constraint, stats
                )
                stats.forward_passes += 1
                state.lookup.extend([anchor, *kept])
                produced += len(run) + len(kept)
                yield [*run, *kept]
                continue
            tokens = proposal.tokens
            step = target_pass((yield Forward([*run, *tokens], hidden_states=True)), layer_ids)
            stats.forward_passes += 1
            step_logits = step.logits[len(run) - 1 :]
            probs = None if proposal.probs is None else proposal.probs.to(step_logits.device)
            accepted, next_token = verify(
                tokens,
                probs,
                step_logits,
                request,
                schedule.verification,
                generator,
                proposal.refused,
                constraint,
                proposal.forced,
            )
            source = proposal.source
            rounds.verified(len(tokens), accepted, source)
            tried, kept = proposal.learnt(accepted)
            if source == "drafter":
                if tried:
                    state.drafts.add(tried, kept, state.survival.conditional(tried))
            elif schedule.verification == "exact":  # unverified, nothing was measured
                state.earned(source).add(proposal.match, request.greedy, tried, kept)
            if proposal.forced:
                stats.forced_tokens += sum(proposal.forced[:accepted])
            state.lookup.extend([anchor, *tokens[:accepted]])
            if len(tokens) > accepted:
                yield Rewind(len(tokens) - accepted)
            if constraint is not None:
                constraint.consume(tokens[:accepted])
            state.pending.append(step.features[: len(run) + accepted])
            logits = step_logits[accepted]  # where the next anchor comes from when verification left none
            produced += len(run) + accepted
            yield [*run, *tokens[:accepted]]
    finally:
        rounds.close()
        if traffic is not None:
            traffic.caches.record(traffic.scope, state.lookup.tokens[state.prompt_length :])

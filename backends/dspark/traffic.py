"""Drafting from the traffic: what the target already wrote for earlier requests drafts the next ones.

An agent sends many requests of one template (the same system prompt, schema or tool, different content), and the
target's answers to them share long spans: keys, punctuation, boilerplate, repeated values. Each finished answer of
a pool enters a :class:`TrafficCache`; a later request's newest tokens are matched against every cached answer, and
what followed the matches drafts its next tokens, verified like any draft, so an output never changes (greedy stays
token-identical, sampling exact: the draft is one-hot). SuffixDecoding (arXiv 2411.04975) showed this on agent
traffic; this is our own design of its rules over a positional index (a suffix trie bounded by depth, read through
the occurrences of the newest tokens):

* **Index.** Answers are kept end to end in one token array, each :data:`MIN_MATCH`-gram pointing at the positions
  it ended at (the most recent :data:`MAX_OCCURRENCES`). Inserting costs one dict append a token.
* **Match.** The context's last ``MIN_MATCH`` tokens find the occurrences; each one's match is extended backwards
  (up to ``depth`` tokens), so a long shared suffix (boilerplate) is told apart from a short one (any JSON key).
* **Draft.** For each match length m among the occurrences, the occurrences matching at least m tokens vote on the
  next token; the most frequent one is followed, its probability the share of votes among those still agreeing,
  multiplied along the path (SuffixDecoding's score). A draft stops where that probability falls below
  ``min_token_prob`` or at ``floor(m * length_factor)`` tokens: a longer match drafts more. The draft with the
  highest summed probability wins (ties to the longer match).
* **Memory.** Bounded by ``max_tokens`` cached tokens over all of a pool's scopes (:class:`TrafficCaches`, the one
  place that evicts); past it the oldest answers go first, and a cache's index is rebuilt without them once they
  are half of it.

Caches are kept per scope (a tenant, or an API key and the tenant within it: :class:`TrafficCaches`), because
acceptance length and timing would tell one tenant whether another's text is cached.
"""

from __future__ import annotations

import threading
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from backends.traffic_settings import MIN_MATCH, TrafficOptions, TrafficSettings

MAX_OCCURRENCES = 32
"""Occurrences an n-gram keeps and a draft weighs, the most recent: an agent's template drifts, and a common n-gram
(a JSON key's quote) would otherwise cost a draft thousands of comparisons."""
MAX_DRAFT = 15
"""The longest traffic draft: the anchor plus 15 is the longest forward one request verifies that the cost curve
profiles (:data:`backends.dspark.profile.ONE_REQUEST`)."""
LEARNT_VOTES = 4.0
"""What the pool's learnt acceptance of traffic drafts weighs against a draft's own votes
(:meth:`TrafficDraft.confidence`)."""
TOKEN_BYTES, POSITION_BYTES, KEY_BYTES = 5, 32, 280
"""What the cache's Python objects cost, fitted to tracemalloc over corpus answers, random and templated traffic
(within 15% on each): a token in the array (and its answer's entry), an indexed position (a list slot and its int),
an n-gram key (its tuple of ints, its list and its dict slot). Diverse text costs about 100 bytes a token, an
agent's templated answers, whose n-grams repeat, nearer 15."""
GAP = -1
"""Between two answers in the array, so a match never runs from one answer into another."""
MAX_FORKS = 2
"""Other paths a draft offers a token tree (:mod:`backends.dspark.tree`): where the earlier answers split, the two
likeliest runner-ups, each followed as far as its own votes carry it."""


@dataclass(frozen=True)
class TrafficDraft:
    tokens: list[int]
    probs: list[float]
    """Each token's probability along the path: the share of agreeing earlier answers, multiplied."""
    match: int
    """How many of the newest tokens the answers it came from share with the context."""
    votes: list[int]
    """How many earlier answers voted at each position (those that agreed up to it): the weight of its share."""
    forks: tuple[TrafficDraft, ...] = ()
    """Other paths after the same match, each leaving this one where the earlier answers split (at most
    :data:`MAX_FORKS`, likeliest first): a token tree's other branches."""

    @property
    def shares(self) -> list[float]:
        """Each token's conditional probability: the share of the voting answers that continued with it."""
        return [p / before for before, p in zip([1.0, *self.probs], self.probs)]

    def confidence(self, learnt: list[float]) -> list[float]:
        """Each position's expected conditional acceptance: the share of earlier answers that continued so,
        weighed by how many voted, against ``learnt`` (what traffic drafts after a match this long earned in the
        pool) worth :data:`LEARNT_VOTES` votes. Ten earlier answers that all continued alike say more about this
        one than the pool's average does; one answer alone says little."""
        return [
            (LEARNT_VOTES * prior + votes * share) / (LEARNT_VOTES + votes)
            for prior, share, votes in zip(learnt, self.shares, self.votes)
        ]


class TrafficCache:
    """One scope's earlier answers, indexed for drafting. Thread-safe: a pool's engine threads and the stream that
    carries other workers' answers write to it while requests read it."""

    def __init__(self, settings: TrafficSettings) -> None:
        self.settings = settings
        self._tokens = array("i")
        self._base = 0
        """The position of ``_tokens[0]`` among every token ever cached: positions never move, so an index entry
        below it points at an evicted answer."""
        self._answers: deque[tuple[int, int]] = deque()
        """(start position, length) of each cached answer, oldest first."""
        self._index: dict[tuple[int, ...], list[int]] = {}
        self._positions = 0
        """Positions held by the index's lists (for :attr:`memory_bytes`)."""
        self._cached = 0
        self._lock = threading.Lock()

    @property
    def cached_tokens(self) -> int:
        return self._cached

    @property
    def answers(self) -> int:
        return len(self._answers)

    @property
    def memory_bytes(self) -> int:
        """About what the cache's objects take: every token kept and indexed (evicted ones until the next rebuild)."""
        return TOKEN_BYTES * len(self._tokens) + POSITION_BYTES * self._positions + KEY_BYTES * len(self._index)

    def insert(self, answer: list[int]) -> bool:
        """A finished answer (its tokens as the target wrote them); whether it was kept (answers too short to match
        are skipped)."""
        if len(answer) <= MIN_MATCH:
            return False
        with self._lock:
            self._tokens.append(GAP)
            start = self._base + len(self._tokens)
            self._tokens.extend(answer)
            self._answers.append((start, len(answer)))
            self._cached += len(answer)
            self._index_positions(start, len(answer))
        return True

    def drop_oldest(self) -> None:
        """Evict the oldest answer: the pool's cap, counted over all its scopes, is past."""
        with self._lock:
            if self._answers:
                _, length = self._answers.popleft()
                self._cached -= length
                self._compact()

    def speculate(
        self, context: list[int], limit: int, options: TrafficOptions | None = None, forks: bool = False
    ) -> TrafficDraft | None:
        """The best draft of at most ``limit`` tokens after ``context`` (the request's prompt and answer so far,
        ending with the anchor), or None where nothing matches; ``options``: the request's (default: the pool's);
        ``forks``: with its other paths (for a token tree)."""
        settings = options or self.settings
        if limit <= 0 or len(context) < MIN_MATCH:
            return None
        with self._lock:
            found = self._index.get(tuple(context[-MIN_MATCH:]))
            if not found:
                return None
            base, oldest = self._base, self._answers[0][0]
            matches = []
            for end in reversed(found[-MAX_OCCURRENCES:]):
                if end < oldest:  # an evicted answer's, and every one before it
                    break
                matches.append((self._match(context, end - base, settings.depth), end - base))
            return best_draft(self._tokens, matches, limit, settings, forks)

    def _match(self, context: list[int], at: int, depth: int) -> int:
        """How many tokens before position ``at`` of the array equal the context's last ones (at least MIN_MATCH,
        which the index matched), up to ``depth``."""
        tokens, match, n = self._tokens, MIN_MATCH, len(context)
        while match < depth and match < n and at - 1 - match >= 0 and tokens[at - 1 - match] == context[n - 1 - match]:
            match += 1
        return match

    def _index_positions(self, start: int, length: int) -> None:
        """Each n-gram of the answer at ``start`` points at the position right after it."""
        tokens, index, offset = self._tokens, self._index, start - self._base
        for i in range(offset + MIN_MATCH, offset + length):
            occurrences = index.setdefault(tuple(tokens[i - MIN_MATCH : i]), [])
            occurrences.append(self._base + i)
            self._positions += 1
            if len(occurrences) > 2 * MAX_OCCURRENCES:
                del occurrences[:MAX_OCCURRENCES]
                self._positions -= MAX_OCCURRENCES

    def _compact(self) -> None:
        """Rebuild the array and index without the dropped answers once they are half of what they hold (each
        token is rebuilt at most once per doubling, so inserting stays O(1) amortised)."""
        first = self._answers[0][0] - 1 if self._answers else self._base + len(self._tokens)
        if 2 * (first - self._base) < len(self._tokens):
            return
        kept = self._tokens[first - self._base :]
        self._base, self._tokens, self._index, self._positions = first, array("i", kept), {}, 0
        for start, length in self._answers:
            self._index_positions(start, length)


def best_draft(
    tokens: Sequence[int], matches: list[tuple[int, int]], limit: int, settings: TrafficOptions, forks: bool = False
) -> TrafficDraft | None:
    """The draft with the highest summed probability among those from each match length (ties to the longer):
    ``matches`` are (match length, position its continuation starts at in ``tokens``), one per occurrence."""
    best: TrafficDraft | None = None
    splits: list[Split] = []
    for m in _match_lengths(matches):
        length = min(limit, MAX_DRAFT, int(m * settings.length_factor))
        found: list[Split] | None = [] if forks else None
        draft = _follow(tokens, [at for match, at in matches if match >= m], length, settings.min_token_prob, found)
        if draft and (best is None or sum(draft[1]) > sum(best.probs)):
            best, splits = TrafficDraft(draft[0], draft[1], m, draft[2]), found or []
    if best is None or not splits:
        return best
    return replace(best, forks=_forks(tokens, best, splits, min(limit, MAX_DRAFT), settings.min_token_prob))


@dataclass(frozen=True)
class Split:
    """Where the earlier answers behind a draft split: at its position ``at``, the runner-up ``token``, the array
    positions of the occurrences that continued with it, and its path probability."""

    at: int
    token: int
    starts: list[int]
    prob: float


def _forks(
    tokens: Sequence[int], draft: TrafficDraft, splits: list[Split], length: int, min_prob: float
) -> tuple[TrafficDraft, ...]:
    """The likeliest splits' paths: the draft up to the split, the runner-up, and what its occurrences continue with
    while the whole path's probability stays at ``min_prob`` or above."""
    forks = []
    for split in sorted(splits, key=lambda s: -s.prob)[:MAX_FORKS]:
        k, prob = split.at, split.prob
        rest = _follow(tokens, [at + k + 1 for at in split.starts], length - k - 1, min_prob / prob)
        more, more_probs, more_votes = rest if rest else ([], [], [])
        forks.append(
            TrafficDraft(
                [*draft.tokens[:k], split.token, *more],
                [*draft.probs[:k], prob, *(prob * p for p in more_probs)],
                draft.match,
                [*draft.votes[:k], draft.votes[k], *more_votes],
            )
        )
    return tuple(forks)


def _match_lengths(matches: list[tuple[int, int]]) -> list[int]:
    """The match lengths a draft is tried from: the three longest among the occurrences, and the shortest (every
    occurrence votes), longest first. Each one more costs a pass over the occurrences."""
    lengths = sorted({match for match, _ in matches}, reverse=True)
    return lengths[:3] + lengths[-1:] if len(lengths) > 4 else lengths


def _follow(
    tokens: Sequence[int], starts: list[int], length: int, min_prob: float, splits: list[Split] | None = None
) -> tuple[list[int], list[float], list[int]] | None:
    """The most-voted path of up to ``length`` tokens from the array positions ``starts`` (each continuing an
    occurrence of the match), with each token's path probability and how many voted for it; None where the first
    token already falls below ``min_prob``. Into ``splits`` (where given), each position where the runner-up kept
    a path probability of ``min_prob``."""
    drafted: list[int] = []
    probs: list[float] = []
    voters: list[int] = []
    prob, alive, end = 1.0, starts, len(tokens)
    for k in range(length):
        votes: dict[int, list[int]] = {}
        for at in alive:
            token = tokens[at + k] if at + k < end else GAP
            if token != GAP:
                votes.setdefault(token, []).append(at)
        if not votes:
            break
        token, agreeing = max(votes.items(), key=lambda item: len(item[1]))
        before = prob
        prob *= len(agreeing) / len(alive)
        if prob < min_prob:
            break
        if splits is not None and len(votes) > 1:
            runner, starts_with = max((item for item in votes.items() if item[0] != token), key=lambda i: len(i[1]))
            if before * len(starts_with) / len(alive) >= min_prob:
                splits.append(Split(k, runner, starts_with, before * len(starts_with) / len(alive)))
        drafted.append(token)
        probs.append(prob)
        voters.append(len(alive))
        alive = agreeing
    return (drafted, probs, voters) if drafted else None


class TrafficCaches:
    """A pool's traffic caches, one per scope (``None``: requests that name none), or one for all where the pool
    shares (``shared``). An answer this process wrote is :meth:`record`-ed, and every listener hears of it (a Redis
    worker publishes it to the pool's other workers); answers from elsewhere go straight into their scope's cache."""

    def __init__(self, settings: TrafficSettings) -> None:
        self.settings = settings
        self._caches: dict[str | None, TrafficCache] = {}
        self._lock = threading.Lock()
        self._order: deque[tuple[str | None, int]] = deque()
        """Every cached answer's scope and length, oldest first, across scopes: what the pool's cap evicts."""
        self._cached = 0
        self._empty = TrafficCache(settings)
        """What a scope with nothing cached drafts from: nothing."""
        self.listeners: list[Callable[[str | None, list[int]], None]] = []

    def record(self, scope: str | None, answer: list[int]) -> None:
        """An answer written here: into its scope's cache, then to every listener."""
        self.insert(scope, answer)
        for listener in self.listeners:
            listener(scope, answer)

    def insert(self, scope: str | None, answer: list[int]) -> None:
        """An answer into its scope's cache, and the pool's oldest answers out while all scopes together hold more
        than ``max_tokens``: a cap per scope alone would let a client that names a new tenant every request (a
        scope each) grow the pool's memory without bound. A scope left empty is forgotten."""
        key = None if self.settings.shared else scope
        with self._lock:
            if not self._cache(key).insert(answer):
                return
            self._order.append((key, len(answer)))
            self._cached += len(answer)
            while self._cached > self.settings.max_tokens and len(self._order) > 1:
                oldest, length = self._order.popleft()
                self._cached -= length
                cache = self._caches[oldest]
                cache.drop_oldest()
                if not cache.answers:
                    del self._caches[oldest]

    def for_scope(self, scope: str | None) -> TrafficCache:
        """The scope's cache to draft from (an empty one where the scope has none: nothing is kept for it)."""
        key = None if self.settings.shared else scope
        with self._lock:
            return self._caches.get(key, self._empty)

    def _cache(self, key: str | None) -> TrafficCache:
        cache = self._caches.get(key)
        if cache is None:
            cache = self._caches[key] = TrafficCache(self.settings)
        return cache

    def scopes(self) -> dict[str | None, TrafficCache]:
        with self._lock:
            return dict(self._caches)

    @property
    def memory_bytes(self) -> int:
        """About what every scope's cache holds (:attr:`TrafficCache.memory_bytes`)."""
        return sum(cache.memory_bytes for cache in self.scopes().values())

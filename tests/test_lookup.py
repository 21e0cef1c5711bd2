"""N-gram lookup: what a copied block proposes, and how its recent acceptance is kept."""

from __future__ import annotations

import pytest

from backends.dspark.lookup import PRIOR, MeasuredAcceptance, NgramLookup
from backends.dspark.published_decode import RecentSurvival, prefers_copy
from backends.scheduling import SpsCurve, VerifySchedule


def test_the_longest_earlier_ngram_ending_with_the_anchor_gives_the_copy():
    lookup = NgramLookup([5, 6, 7, 8, 9, 1, 7, 2, 3, 5, 6])
    assert lookup.propose(7, 3) == [8, 9, 1], "unigram 7 alone would match (7, 2, 3, 5); the trigram 5 6 7 decides"
    lookup = NgramLookup([1, 2, 3, 4, 5, 9, 9, 2, 3])
    assert lookup.propose(4, 4) == [5, 9, 9, 2]
    assert lookup.propose(42, 4) == [], "a token never seen proposes nothing"


def test_the_latest_occurrence_wins_and_committed_tokens_join_the_index():
    lookup = NgramLookup([7, 1, 2, 10, 7, 1, 2, 20, 7, 1])
    assert lookup.propose(2, 1) == [20], "7 1 2 occurs twice; the later one was followed by 20"
    lookup.extend([2, 30, 31])
    assert lookup.propose(1, 2) == [2, 30], "the tokens committed after the prompt are copied too"


def test_a_single_token_match_needs_two_tokens_to_copy():
    assert NgramLookup([4, 5]).propose(4, 4) == [], "one copied token after a unigram match is not worth a round"
    assert NgramLookup([4, 5, 6]).propose(4, 4) == [5, 6]


def test_measured_acceptance_follows_outcomes_from_its_prior():
    survival = MeasuredAcceptance()
    prior = [PRIOR] * 3
    assert survival.confidence(prior) == prior
    survival.add(verified=3, accepted=1, prior=prior)
    first, second, third = survival.confidence(prior)
    assert first > PRIOR > second and third == PRIOR, "position 3 was never reached: no evidence on it"
    for _ in range(6):
        survival.add(verified=3, accepted=3, prior=prior)
    assert all(c > 0.95 for c in survival.confidence(prior))


def test_the_hybrid_copies_only_where_copies_have_earned_more_than_drafts():
    """``lookup: beside`` verifies a copied block only when the copies' measured acceptance, over the verifying
    forward, beats the drafter's measured acceptance over the forward plus its own pass."""
    flat = VerifySchedule(sps=SpsCurve({n: 100.0 for n in range(1, 16)}), draft_s=0.002)
    copies, drafts = MeasuredAcceptance(), MeasuredAcceptance()
    prior = [PRIOR] * 6
    for _ in range(5):
        copies.add(verified=6, accepted=1, prior=prior)  # copies fail after one token
        drafts.add(verified=6, accepted=6, prior=[0.5] * 6)  # the drafter's blocks all pass
    assert not prefers_copy(flat, copies.confidence(prior), drafts.confidence([0.5] * 6))
    for _ in range(5):
        copies.add(verified=6, accepted=6, prior=prior)
        drafts.add(verified=6, accepted=0, prior=[0.5] * 6)
    assert prefers_copy(flat, copies.confidence(prior), drafts.confidence([0.5] * 6))
    # The same measured acceptance: the copy wins, since it saves the drafter's pass.
    same = [0.8] * 6
    assert prefers_copy(flat, same, same)
    assert not prefers_copy(VerifySchedule(sps=flat.sps, draft_s=0.002), [0.2] * 6, same)


def test_the_drafters_prior_is_its_own_conditional_confidence():
    survival = RecentSurvival()
    survival.add([0.9, 0.5, 0.5])
    assert survival.conditional(4) == pytest.approx([0.9, 0.5, 0.5, 1.0])

"""N-gram lookup: what a copied block proposes, and how its recent acceptance is kept."""

from __future__ import annotations

import pytest

from backends.dspark.lookup import LONGEST_MATCH, Copy, CopyAcceptance, MeasuredAcceptance, NgramLookup
from backends.dspark.published_decode import LookedUp, RecentSurvival, chosen
from backends.scheduling import SpsCurve, VerifySchedule


def test_the_longest_earlier_ngram_ending_with_the_anchor_gives_the_copy():
    lookup = NgramLookup([5, 6, 7, 8, 9, 1, 7, 2, 3, 5, 6])
    assert lookup.propose(7, 3) == Copy([8, 9, 1], match=3), "unigram 7 alone would copy 2 3 5; 5 6 7 decides"
    lookup = NgramLookup([1, 2, 3, 4, 5, 9, 9, 2, 3])
    assert lookup.propose(4, 4) == Copy([5, 9, 9, 2], match=3)
    assert lookup.propose(42, 4) is None, "a token never seen proposes nothing"
    assert lookup.propose(4, 0) is None, "no room left: nothing to copy"
    assert NgramLookup([4, 5]).propose(4, 4) == Copy([5, 4, 5, 4], match=1), "past the present, the copy repeats"


def test_the_alternative_copy_is_the_latest_occurrence_that_went_on_otherwise():
    lookup = NgramLookup([7, 1, 2, 10, 7, 1, 2, 20, 7, 1])
    assert lookup.propose(2, 2).tokens == [20, 7] and lookup.alternative(2, 2) == Copy([10, 7], match=3)
    assert NgramLookup([7, 1, 2, 20, 7, 1, 2, 20]).alternative(2, 2) is None, "every occurrence went on alike"
    assert lookup.alternative(42, 2) is None


def test_a_copy_that_runs_into_the_present_repeats_the_period_its_match_found():
    lookup = NgramLookup([9, 1, 2, 3, 1, 2])
    assert lookup.propose(3, 7).tokens == [1, 2, 3, 1, 2, 3, 1], "1 2 3 1 2 3: period 3"
    assert lookup.propose(3, 2).tokens == [1, 2], "within what is known, nothing repeats"


def test_the_latest_occurrence_wins_and_committed_tokens_join_the_index():
    lookup = NgramLookup([7, 1, 2, 10, 7, 1, 2, 20, 7, 1])
    assert lookup.propose(2, 1).tokens == [20], "7 1 2 occurs twice; the later one was followed by 20"
    lookup.extend([2, 30, 31])
    assert lookup.propose(1, 2).tokens == [2, 30], "the tokens committed after the prompt are copied too"


def test_the_match_is_measured_back_beyond_the_longest_ngram():
    """A copy's match counts every token before the anchor that agrees with those before the earlier occurrence,
    up to ``LONGEST_MATCH``: the evidence its acceptance is kept by."""
    line = list(range(100, 110))
    lookup = NgramLookup([*line, 1, 2, 3, 9, *line])
    assert lookup.propose(1, 3) == Copy([2, 3, 9], match=len(line) + 1)
    long_line = list(range(100, 100 + 2 * LONGEST_MATCH))
    assert NgramLookup([*long_line, 5, *long_line]).propose(5, 2).match == LONGEST_MATCH


def test_copy_acceptance_is_kept_by_match_length_and_position():
    """Short matches that miss do not condemn long ones (one estimate for all copies did: two misses stopped
    copying for the rest of a request where verifying costs), and greedy and sampled copies learn apart."""
    copies = CopyAcceptance()
    prior = CopyAcceptance.PRIOR
    assert copies.confidence(1, 3, greedy=True) == [prior] * 3
    for _ in range(20):
        copies.add(match=1, greedy=True, verified=3, accepted=0)
        copies.add(match=12, greedy=True, verified=3, accepted=3)
    short, long = copies.confidence(1, 3, greedy=True), copies.confidence(13, 3, greedy=True)
    assert short[0] < 0.1 and short[1:] == [prior, prior], "positions after a first miss were never reached"
    assert all(c > 0.9 for c in long)
    assert copies.confidence(12, 3, greedy=False) == [prior] * 3, "sampled copies have their own estimate"


def test_copies_passed_over_drift_back_to_the_prior_and_are_tried_again():
    """An estimate only a verified copy can revise must not stay shut: every ``PROBE_AFTER`` passed-over copies
    of a kind in a row halve its evidence."""
    copies = CopyAcceptance()
    for _ in range(4):
        copies.add(match=2, greedy=True, verified=1, accepted=0)
    shut = copies.confidence(2, 1, greedy=True)[0]
    for _ in range(CopyAcceptance.PROBE_AFTER - 1):
        copies.add(match=2, greedy=True, verified=0, accepted=0)
    assert copies.confidence(2, 1, greedy=True)[0] == shut
    copies.add(match=2, greedy=True, verified=0, accepted=0)
    reopened = copies.confidence(2, 1, greedy=True)[0]
    assert shut < reopened < CopyAcceptance.PRIOR
    for _ in range(8 * CopyAcceptance.PROBE_AFTER):
        copies.add(match=2, greedy=True, verified=0, accepted=0)
    assert copies.confidence(2, 1, greedy=True)[0] == pytest.approx(CopyAcceptance.PRIOR, abs=0.01)


def test_copy_acceptance_follows_recent_copies_within_its_window():
    copies = CopyAcceptance()
    for _ in range(int(CopyAcceptance.WINDOW)):
        copies.add(match=4, greedy=True, verified=1, accepted=1)
    for _ in range(int(CopyAcceptance.WINDOW)):
        copies.add(match=4, greedy=True, verified=1, accepted=0)
    assert copies.confidence(4, 1, greedy=True)[0] < 0.5, "old outcomes are scaled down, not kept for ever"


def test_measured_acceptance_follows_outcomes_from_its_prior():
    survival = MeasuredAcceptance()
    prior = [0.7] * 3
    assert survival.confidence(prior) == prior
    survival.add(verified=3, accepted=1, prior=prior)
    first, second, third = survival.confidence(prior)
    assert first > 0.7 > second and third == 0.7, "position 3 was never reached: no evidence on it"
    for _ in range(6):
        survival.add(verified=3, accepted=3, prior=prior)
    assert all(c > 0.95 for c in survival.confidence(prior))


def prefers_copy(schedule: VerifySchedule, copy: list[float], draft: list[float]) -> bool:
    return chosen(schedule, [LookedUp([1] * len(copy), copy, 3, "copy")], draft) is not None


def test_the_hybrid_copies_only_where_copies_have_earned_more_than_drafts():
    """``lookup: beside`` verifies a copied block only when the copies' measured acceptance, over the verifying
    forward, beats the drafter's measured acceptance over the forward plus its own pass."""
    flat = VerifySchedule(sps=SpsCurve({n: 100.0 for n in range(1, 16)}), draft_s=0.002)
    copies, drafts = CopyAcceptance(), MeasuredAcceptance()
    for _ in range(5):
        copies.add(match=3, greedy=True, verified=6, accepted=1)  # copies fail after one token
        drafts.add(verified=6, accepted=6, prior=[0.5] * 6)  # the drafter's blocks all pass
    assert not prefers_copy(flat, copies.confidence(3, 6, greedy=True), drafts.confidence([0.5] * 6))
    for _ in range(20):
        copies.add(match=3, greedy=True, verified=6, accepted=6)
        drafts.add(verified=6, accepted=0, prior=[0.5] * 6)
    assert prefers_copy(flat, copies.confidence(3, 6, greedy=True), drafts.confidence([0.5] * 6))
    # The same measured acceptance: the copy wins, since it saves the drafter's pass.
    same = [0.8] * 6
    assert prefers_copy(flat, same, same)
    assert not prefers_copy(VerifySchedule(sps=flat.sps, draft_s=0.002), [0.2] * 6, same)


def test_of_two_looked_up_blocks_the_one_expected_to_commit_more_is_verified():
    """A traffic draft whose earlier answers agreed beside a copy that keeps failing: the round takes the draft;
    under ``lookup: only`` a block is taken whatever drafting would do."""
    flat = VerifySchedule(sps=SpsCurve({n: 100.0 for n in range(1, 16)}), draft_s=0.002)
    copy = LookedUp([1, 2], [0.2, 0.2], 2, "copy")
    traffic = LookedUp([3, 4, 5, 6], [0.95] * 4, 12, "traffic")
    assert chosen(flat, [copy, traffic], [0.5] * 6) is traffic
    assert chosen(flat, [copy], [0.9] * 6) is None
    assert chosen(VerifySchedule(sps=flat.sps, lookup="only"), [copy], [0.9] * 6) is copy


def test_the_drafters_prior_is_its_own_conditional_confidence():
    survival = RecentSurvival()
    survival.add([0.9, 0.5, 0.5])
    assert survival.conditional(4) == pytest.approx([0.9, 0.5, 0.5, 1.0])

"""N-gram lookup: what a copied block proposes, and how its recent acceptance is kept."""

from __future__ import annotations

from backends.dspark.lookup import PRIOR, LookupSurvival, NgramLookup


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


def test_survival_follows_outcomes_from_its_prior():
    survival = LookupSurvival()
    assert survival.confidence(3) == [PRIOR] * 3
    survival.add(verified=3, accepted=1)
    first, second, third = survival.confidence(3)
    assert first > PRIOR > second and third == PRIOR, "position 3 was never reached: no evidence on it"
    for _ in range(6):
        survival.add(verified=3, accepted=3)
    assert all(c > 0.95 for c in survival.confidence(3))

"""``bench copies``: the replay of copied blocks on fixed greedy answers, its rules and its report."""

from __future__ import annotations

import argparse
import json

import pytest

from backends.default_model import DEFAULT_DRAFTERS
from backends.dspark.lookup import CopyAcceptance
from backends.scheduling import SpsCurve, VerifySchedule
from benchmarks import copies
from benchmarks.copies import Answer, MatchTable, OurCopies, PromptLookup, WholeCopies, replay, timed

FLAT = SpsCurve({n: 100.0 for n in range(1, 17)})
"""Verifying is free: every token that may survive is worth verifying."""
LINEAR = SpsCurve({n: 100.0 / n for n in range(1, 17)})
"""A forward of n tokens costs n steps: no draft ever pays."""

PROMPT = list(range(100, 140))
ECHO = Answer(PROMPT, [*PROMPT[5:], 7, 8, 9])
"""An answer that repeats most of its prompt, then says something new."""


def ours(answers: list[Answer], sps: SpsCurve) -> list[tuple[int, int]]:
    pool = CopyAcceptance()
    return replay(answers, lambda answer: OurCopies(answer, pool, VerifySchedule(sps=sps)))


def test_every_rule_commits_the_whole_answer_and_copies_an_echo_in_long_blocks():
    for rounds in (
        ours([ECHO], FLAT),
        replay([ECHO], PromptLookup),
        replay([ECHO], lambda a: WholeCopies(a, MatchTable())),
    ):
        assert sum(1 + kept for _, kept in rounds) == len(ECHO.completion)
        assert all(kept <= verified for verified, kept in rounds)
        assert timed(rounds, FLAT)["tokens_per_forward"] > 3.0


def test_where_no_draft_pays_our_rule_verifies_nothing_and_prompt_lookup_loses_time():
    rounds = ours([ECHO], LINEAR)
    assert all(verified == 0 for verified, _ in rounds)
    assert timed(rounds, LINEAR) == {"tokens_per_forward": 1.0, "mean_verified": 0.0, "speedup": pytest.approx(1.0)}
    assert timed(replay([ECHO], PromptLookup), LINEAR)["speedup"] < 1.0


def test_prompt_lookup_copies_after_the_earliest_occurrence():
    answer = Answer([5, 6, 1, 5, 6, 2], [5, 6, 1])
    rule = PromptLookup(answer)
    assert rule.propose(6, 10) == [1, 5, 6, 2], "5 6 first occurred before 1, not before 2"
    assert rule.propose(6, 2) == [1, 5], "no more than the room left"


def test_the_match_table_counts_positions_reached():
    table = MatchTable()
    table.add(match=3, verified=4, kept=2)
    table.add(match=3, verified=4, kept=4)
    entry = table.report()["3"]
    assert entry["copies"] == 2
    assert entry["conditional_acceptance"][:4] == [1.0, 1.0, 0.5, 1.0]
    assert entry["conditional_acceptance"][4] is None


def test_bench_copies_on_the_shipped_corpus(tmp_path):
    out = tmp_path / "copies.json"
    args = argparse.Namespace(drafters=DEFAULT_DRAFTERS, answers=12, seed=0, json=str(out), plots=tmp_path / "plots")
    assert copies.run(args) == 0
    report = json.loads(out.read_text())
    assert report["answers"] == 12 and report["acceptance_by_match"]
    for rules in report["machines"].values():
        assert set(rules) == {"copies", "copies_whole", "prompt_lookup"}
        assert all(r["tokens_per_forward"] >= 1.0 for r in rules.values())
    assert (tmp_path / "plots" / "copies.png").is_file()

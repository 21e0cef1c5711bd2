"""``dspark-router bench copies``: copied blocks replayed on the target's own greedy answers, on every stored
cost curve.

A greedy answer is fixed, so what a copy would commit needs no model: at each round the copy proposed from the
tokens so far keeps as many tokens as agree with the answer's next ones. Timing each forward by a machine's
profiled curve (``dspark_sps.json``) then says, for every machine a curve was stored for, how many tokens the
decode loop's rule for copies commits per verifying forward and how fast that is against plain decoding, beside
transformers' prompt lookup (the earliest match of the newest 2 tokens, else 1, and 10 tokens verified every
round). Every copy is also replayed verified whole, giving its acceptance by the length of its match and by
position: what :class:`~backends.dspark.lookup.CopyAcceptance` learns per pool.

The answers are the shipped corpus's greedy ones: the standard-library requests and the generator's subtasks
(the synthesised turns are partly sampled). Some subtasks answer under a grammar, whose forced tokens the loop
commits without drafting; the replay drafts there too, for both rules alike. This is training text: bench
decode measures the evaluation prompts on the target itself.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Protocol

from backends.corpus.recipe import source_family
from backends.default_model import DEFAULT_DRAFTERS
from backends.dspark.lookup import MATCH_CLASSES, Copy, CopyAcceptance, NgramLookup, match_class
from backends.progress import JobProgress
from backends.scheduling import PROFILE_FILE, SpsCurve, VerifySchedule, prefix_survival
from benchmarks.output import write_json, write_plots

GREEDY_SOURCES = ("stdlib", "subtask")
BLOCK = 7
"""The published drafter's block, which caps a copy in the decode loop."""
PEER_NGRAM = 2
"""transformers' ``max_matching_ngram_size`` default."""
PEER_TOKENS = 10
"""``prompt_lookup_num_tokens`` as bench decode runs it."""


@dataclass(frozen=True)
class Answer:
    prompt: list[int]
    completion: list[int]


class Rule(Protocol):
    """How one answer's rounds draft: the tokens to verify after the anchor, given the room left; then what the
    round committed (the anchor and the kept tokens) out of how many verified."""

    def propose(self, anchor: int, room: int) -> list[int]: ...

    def committed(self, tokens: list[int], verified: int) -> None: ...


class OurCopies:
    """The decode loop's rule with ``lookup: only``: the pool's :class:`CopyAcceptance` (one for every answer, as
    one pool's), and Algorithm 1 choosing how much of each copy to verify on ``schedule``'s curve."""

    def __init__(self, answer: Answer, copies: CopyAcceptance, schedule: VerifySchedule) -> None:
        self.lookup, self.copies, self.schedule = NgramLookup(answer.prompt), copies, schedule
        self.copy: Copy | None = None

    def propose(self, anchor: int, room: int) -> list[int]:
        self.copy = self.lookup.propose(anchor, min(BLOCK, room))
        if self.copy is None:
            return []
        confidence = self.copies.confidence(self.copy.match, len(self.copy.tokens), greedy=True)
        budget = self.schedule.budget(1, len(self.copy.tokens), prefix_survival(confidence))
        return self.copy.tokens[: self.schedule.length(confidence, budget) if budget else 0]

    def committed(self, tokens: list[int], verified: int) -> None:
        if self.copy is not None:
            self.copies.add(self.copy.match, True, verified, len(tokens) - 1)
        self.lookup.extend(tokens)


class WholeCopies:
    """The same copies verified whole, every one counted by its match class in ``table``."""

    def __init__(self, answer: Answer, table: MatchTable) -> None:
        self.lookup, self.table = NgramLookup(answer.prompt), table
        self.copy: Copy | None = None

    def propose(self, anchor: int, room: int) -> list[int]:
        self.copy = self.lookup.propose(anchor, min(BLOCK, room))
        return self.copy.tokens if self.copy else []

    def committed(self, tokens: list[int], verified: int) -> None:
        if self.copy is not None:
            self.table.add(self.copy.match, verified, len(tokens) - 1)
        self.lookup.extend(tokens)


class PromptLookup:
    """transformers' rule: the tokens after the earliest occurrence, with any after it, of the newest
    ``PEER_NGRAM`` tokens (else fewer); ``PEER_TOKENS`` of them verified every round."""

    def __init__(self, answer: Answer) -> None:
        self.seen: list[int] = []
        self.first: dict[tuple[int, ...], int] = {}
        self.committed(answer.prompt, 0)

    def propose(self, anchor: int, room: int) -> list[int]:
        history = [*self.seen[-(PEER_NGRAM - 1) :], anchor]
        for n in range(min(PEER_NGRAM, len(history)), 0, -1):
            begin = self.first.get(tuple(history[-n:]))
            if begin is not None:
                return self.seen[begin : begin + min(PEER_TOKENS, room)]
        return []

    def committed(self, tokens: list[int], verified: int) -> None:
        for token in tokens:
            end = len(self.seen)
            for n in range(1, min(PEER_NGRAM, end) + 1):
                self.first.setdefault(tuple(self.seen[end - n : end]), end)
            self.seen.append(token)


@dataclass
class MatchTable:
    """Conditional acceptance of a copied token by its copy's match class and block position."""

    tried: list[list[int]] = field(default_factory=lambda: [[0] * BLOCK for _ in MATCH_CLASSES])
    kept: list[list[int]] = field(default_factory=lambda: [[0] * BLOCK for _ in MATCH_CLASSES])

    def add(self, match: int, verified: int, kept: int) -> None:
        kind = match_class(match)
        for k in range(min(verified, kept + 1)):
            self.tried[kind][k] += 1
            self.kept[kind][k] += k < kept

    def report(self) -> dict[str, dict]:
        return {
            str(bound): {
                "copies": tried[0],
                "conditional_acceptance": [k / t if t else None for k, t in zip(kept, tried)],
            }
            for bound, tried, kept in zip(MATCH_CLASSES, self.tried, self.kept)
            if tried[0]
        }


def replay(answers: list[Answer], rule_for: Callable[[Answer], Rule]) -> list[tuple[int, int]]:
    """Every round of every answer as (tokens verified, tokens kept)."""
    rounds = []
    for answer in answers:
        rule = rule_for(answer)
        tokens = answer.prompt + answer.completion
        i = len(answer.prompt)
        while i < len(tokens):
            drafted = rule.propose(tokens[i], len(tokens) - i - 1)
            kept = 0
            while kept < len(drafted) and drafted[kept] == tokens[i + 1 + kept]:
                kept += 1
            rule.committed(tokens[i : i + 1 + kept], len(drafted))
            rounds.append((len(drafted), kept))
            i += 1 + kept
    return rounds


def timed(rounds: list[tuple[int, int]], sps: SpsCurve) -> dict[str, float]:
    """Tokens per verifying forward (bonus included), and tokens per second over plain decoding's, each forward
    timed by ``sps``."""
    tokens = sum(1 + kept for _, kept in rounds)
    seconds = sum(1.0 / sps.at(1 + verified) for verified, _ in rounds)
    return {
        "tokens_per_forward": tokens / len(rounds),
        "mean_verified": sum(verified for verified, _ in rounds) / len(rounds),
        "speedup": tokens / sps.at(1) / seconds,
    }


def read_answers(corpus: Path, limit: int, seed: int) -> list[Answer]:
    """A seeded ``limit`` of the corpus's greedy answers."""
    from backends.training.dataset import DISTILL_FILE  # the corpus's writer; heavy to import with every CLI call

    with gzip.open(corpus / f"{DISTILL_FILE}.gz", "rt", encoding="utf-8") as lines:
        records = [json.loads(line) for line in lines]
    greedy = [Answer(r["prompt"], r["completion"]) for r in records if source_family(r["source"]) in GREEDY_SOURCES]
    random.Random(seed).shuffle(greedy)
    return greedy[:limit]


def measure(answers: list[Answer], curves: dict[str, SpsCurve]) -> dict:
    table = MatchTable()
    whole = replay(answers, lambda answer: WholeCopies(answer, table))
    peer = replay(answers, PromptLookup)
    report: dict = {
        "answers": len(answers),
        "answer_tokens": sum(len(a.completion) for a in answers),
        "block": BLOCK,
        "acceptance_by_match": table.report(),
        "machines": {},
    }
    with JobProgress() as progress:
        job = progress.add_job("bench copies", len(curves))
        for key, sps in curves.items():
            ours = replay(answers, partial(OurCopies, copies=CopyAcceptance(), schedule=VerifySchedule(sps=sps)))
            report["machines"][key] = {
                "copies": timed(ours, sps),
                "copies_whole": timed(whole, sps),
                "prompt_lookup": timed(peer, sps),
            }
            progress.step(job, status=key.split("|", 1)[1])
    return report


def stored_curves(folder: Path) -> dict[str, SpsCurve]:
    stored = json.loads((folder / PROFILE_FILE).read_text(encoding="utf-8"))
    return {key: SpsCurve.from_stored(curve).monotone() for key, curve in sorted(stored.items())}


def draw(report: dict, folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    machines = list(report["machines"])
    rules = ("copies", "copies_whole", "prompt_lookup")
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.5 * len(machines) + 2), sharey=True)
    for ax, measure_name in zip(axes, ("tokens_per_forward", "speedup")):
        for i, rule in enumerate(rules):
            values = [report["machines"][m][rule][measure_name] for m in machines]
            ax.barh([j + 0.27 * (i - 1) for j in range(len(machines))], values, height=0.27, label=rule)
        ax.set_title(measure_name.replace("_", " "))
    axes[0].set_yticks(range(len(machines)), [m.removeprefix("cpu:") for m in machines], fontsize=7)
    axes[1].axvline(1.0, color="grey", linewidth=0.8)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    path = folder / "copies.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--drafters", type=Path, default=DEFAULT_DRAFTERS, help="the folder with the corpus and curves")
    parser.add_argument("--answers", type=int, default=800, help="greedy corpus answers replayed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--plots", type=Path, help="write the PNG to this folder")


def run(args: argparse.Namespace) -> int:
    answers = read_answers(args.drafters / "corpus", args.answers, args.seed)
    report = measure(answers, stored_curves(args.drafters))
    for key, rules in report["machines"].items():
        print(key.removeprefix("cpu:"))
        for rule, numbers in rules.items():
            print(f"  {rule:14} {numbers['tokens_per_forward']:5.2f} a forward  {numbers['speedup']:5.2f}x plain")
    write_json(args.json, report)
    write_plots(args.plots, report, draw)
    return 0

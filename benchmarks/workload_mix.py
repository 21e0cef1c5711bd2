"""The traffic of ``bench workload``: a seeded mix of agent subtasks and real benchmark prompts, and the open-loop
arrival times at which it comes in.

The mix, stated once here and never tuned to a policy: two thirds held-out subtasks, every kind of
:mod:`backends.corpus.subtasks` in equal shares, each with the sampling settings its kind draws (mostly greedy for the
deterministic kinds, mostly sampled for the open-ended ones); one third the real prompts of ``--prompts``
(``../shared/data/prompts``: evaluation only, nothing is fitted on them), every set in equal shares, greedy.
The subtasks use a seed that neither the classifier's corpus nor the drafters' training nor another benchmark
uses, so their wording is new to the expected-gain model (their templates are not: see ``split`` per item).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends.corpus.subtasks import generate_subtasks, read_jsonl
from benchmarks.decode_sets import shared_sets
from classifiers.corpus import CORPUS_PATH, template_splits

HELD_OUT_SEED = 9_003
SUBTASK_SHARE = 2 / 3


@dataclass(frozen=True)
class WorkItem:
    """One request of the workload, as a client sends it (chat-completions arguments, seeded)."""

    name: str
    group: str
    """The subtask's kind, or the prompt set's name."""
    source: str
    """``subtask`` or ``prompt``."""
    split: str | None
    """For subtasks: the split of their template in the classifier's corpus (``test``: never fitted on)."""
    request: dict[str, Any]

    @property
    def greedy(self) -> bool:
        return self.request["temperature"] == 0


def build_workload(size: int, prompts: Path | None, max_tokens: int) -> list[WorkItem]:
    """``size`` items in the stated proportions (all subtasks without ``prompts``), interleaved by a seeded
    shuffle. Each request carries its own seed, so a sampled one decodes the same on every run."""
    n_prompts = round(size * (1 - SUBTASK_SHARE)) if prompts is not None else 0
    items = _subtasks(size - n_prompts, max_tokens) + _prompts(prompts, n_prompts, max_tokens)
    random.Random(HELD_OUT_SEED).shuffle(items)
    return [
        WorkItem(item.name, item.group, item.source, item.split, {**item.request, "seed": index})
        for index, item in enumerate(items)
    ]


def _subtasks(count: int, max_tokens: int) -> list[WorkItem]:
    if count <= 0:
        return []
    splits = template_splits(read_jsonl(CORPUS_PATH))
    chosen = generate_subtasks(count, seed=HELD_OUT_SEED)
    return [
        WorkItem(
            name=f"{subtask.kind}/{i}",
            group=subtask.kind,
            source="subtask",
            split=splits.get(subtask.template),
            request={**subtask.to_request_dict(), "max_tokens": min(subtask.max_tokens, max_tokens)},
        )
        for i, subtask in enumerate(chosen)
    ]


def _prompts(folder: Path | None, count: int, max_tokens: int) -> list[WorkItem]:
    if folder is None or count <= 0:
        return []
    names = sorted(file.stem for file in folder.glob("*.jsonl"))
    if not names:
        return []
    per_set = -(-count // len(names))
    sets = shared_sets(folder, per_set, max_tokens, [0.0])
    rows = [(prompt_set.name, i, request) for prompt_set in sets for i, request in enumerate(prompt_set.requests)]
    rows.sort(key=lambda row: (row[1], row[0]))  # round-robin over the sets, so every set keeps its share
    return [
        WorkItem(
            name=f"{name}/{i}",
            group=name,
            source="prompt",
            split=None,
            request={
                "messages": [message.model_dump(exclude_none=True) for message in request.messages],
                "temperature": 0.0,
                "max_tokens": request.max_tokens,
            },
        )
        for name, i, request in rows[:count]
    ]


def arrivals(rate: float, count: int, items: int, seed: int, round_index: int = 0) -> list[tuple[float, int]]:
    """``count`` Poisson arrivals at ``rate`` per second (seconds from the start, item index), seeded by the
    rate and round, so every policy in one round at one rate gets exactly the same requests at the same moments."""
    rng = random.Random(f"{seed}:{rate:.6f}:{round_index}")
    clock, schedule = 0.0, []
    for _ in range(count):
        clock += rng.expovariate(rate)
        schedule.append((clock, rng.randrange(items)))
    return schedule

"""The drafters' training corpus: which sources, how many of each, how each is answered, and what was kept.

Sources (each one file in this folder):

- ``subtask:<kind>``: the generator's agent subtasks (:mod:`backends.corpus.subtasks`), with their response
  formats and tools, answered greedily under their constraints as the DSpark pool serves them;
- ``stdlib:code`` / ``stdlib:prose``: requests about the standard library's code and docstrings
  (:mod:`backends.corpus.stdlib`);
- ``synth:<domain>``: first turns the target writes itself (:mod:`backends.corpus.synthesis`);
- ``follow-up:<domain>``: second turns the target writes after one of those conversations.

Self-synthesised turns are answered greedily or, for ``sampled_share`` of them, sampled at
``SAMPLED_TEMPERATURE`` with a seed of their own, as agents send open-ended requests. Every prompt passes the
evaluation filter (:mod:`backends.corpus.evaluation`) and a duplicate filter (the same words in the same
messages), and the :class:`Manifest` counts what each source made, dropped and answered.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from backends.corpus.evaluation import EvaluationFilter, words
from backends.corpus.stdlib import stdlib_requests
from backends.corpus.subtasks import generate_subtasks
from backends.corpus.synthesis import Conversation, system_messages
from backends.types import GenerationRequest

DISTILL_SEED = 0
"""The seed the drafters' corpus is made with; the classifier's corpus, the benchmarks and tuning use others."""
SAMPLED_TEMPERATURE = 1.0
MANIFEST_FILE = "corpus_manifest.json"


def source_family(source: str) -> str:
    """The family of a source (``synth`` of ``synth:math``) or of a sequence key that starts with one."""
    return source.split(":", 1)[0]


@dataclass(frozen=True)
class CorpusRecipe:
    """How many prompts of each source, and how they are answered; the defaults are what ``make model`` runs."""

    subtasks: int = 5000
    stdlib: int = 3500
    synthesised: int = 24000
    follow_ups: int = 2500
    max_tokens: int = 256
    sampled_share: float = 0.3
    seed: int = DISTILL_SEED


@dataclass(frozen=True)
class TrainingPrompt:
    source: str
    """``subtask:<kind>``, ``stdlib:code``, ``stdlib:prose``, ``synth:<domain>`` or ``follow-up:<domain>``."""
    request: GenerationRequest


@dataclass
class SourceCount:
    made: int = 0
    evaluation_overlap: int = 0
    duplicates: int = 0
    kept: int = 0
    answered: int = 0
    """Kept and answered: a prompt too long for the model's context with its max_tokens is not."""
    answer_tokens: int = 0


@dataclass
class Manifest:
    """What the recipe made, per source family (``subtask``, ``stdlib``, ``synth``, ``follow-up``), and the
    synthesised turns that did not read as requests (``unusable``)."""

    recipe: CorpusRecipe
    sources: dict[str, SourceCount] = field(default_factory=dict)
    unusable: Counter = field(default_factory=Counter)

    def count(self, source: str) -> SourceCount:
        return self.sources.setdefault(source_family(source), SourceCount())

    @property
    def answer_tokens(self) -> int:
        return sum(c.answer_tokens for c in self.sources.values())

    def save(self, path: Path) -> None:
        data = {
            "recipe": asdict(self.recipe),
            "sources": {name: asdict(count) for name, count in sorted(self.sources.items())},
            "unusable_synthesised_turns": dict(self.unusable),
            "sequences": sum(c.answered for c in self.sources.values()),
            "answer_tokens": self.answer_tokens,
        }
        path.write_text(json.dumps(data, indent=2) + "\n")


class PromptFilter:
    """Drops prompts that overlap an evaluation prompt or repeat an earlier one, counting both."""

    def __init__(self, evaluation: EvaluationFilter, manifest: Manifest) -> None:
        self.evaluation, self.manifest = evaluation, manifest
        self.seen: set[str] = set()

    def __call__(self, prompts: list[TrainingPrompt]) -> list[TrainingPrompt]:
        kept = []
        for prompt in prompts:
            count = self.manifest.count(prompt.source)
            count.made += 1
            tokens = words(_text(prompt.request))
            key = " ".join(tokens)
            if self.evaluation.overlaps(tokens):
                count.evaluation_overlap += 1
            elif key in self.seen:
                count.duplicates += 1
            else:
                self.seen.add(key)
                count.kept += 1
                kept.append(prompt)
        return kept


def given_prompts(recipe: CorpusRecipe) -> list[TrainingPrompt]:
    """The prompts that need no model to write: generator subtasks (greedy, under their formats and tools) and
    standard-library requests."""
    prompts = [
        TrainingPrompt(
            f"subtask:{subtask.kind}",
            GenerationRequest(
                messages=subtask.messages,
                response_format=subtask.response_format,
                tools=subtask.tools,
                max_tokens=min(subtask.max_tokens, recipe.max_tokens),
                temperature=0.0,
            ),
        )
        for subtask in generate_subtasks(recipe.subtasks, seed=recipe.seed)
    ]
    return prompts + [TrainingPrompt(s, r) for s, r in stdlib_requests(recipe.stdlib, recipe.max_tokens, recipe.seed)]


def conversation_prompts(recipe: CorpusRecipe, conversations: list[Conversation], stage: str) -> list[TrainingPrompt]:
    """Each conversation, ending in a synthesised user turn, as a request to answer: greedy, or sampled with its
    own seed for ``sampled_share`` of them."""
    rng = random.Random(f"answers:{recipe.seed}:{stage}")
    prompts = []
    for conversation in conversations:
        sampled = rng.random() < recipe.sampled_share
        seed = rng.getrandbits(31)
        request = GenerationRequest(
            messages=[*system_messages(conversation.domain), *conversation.messages],
            max_tokens=recipe.max_tokens,
            temperature=SAMPLED_TEMPERATURE if sampled else 0.0,
            seed=seed if sampled else None,
        )
        prompts.append(TrainingPrompt(f"{stage}:{conversation.domain}", request))
    return prompts


def _text(request: GenerationRequest) -> str:
    if request.messages is None:
        return request.prompt or ""
    return "\n".join(m.content for m in request.messages if isinstance(m.content, str))

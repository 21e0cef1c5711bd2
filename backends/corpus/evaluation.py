"""The evaluation prompts, kept out of every training corpus.

``../shared/data/prompts`` (HumanEval, MBPP, GSM8K, MATH-500, MT-Bench) and the hand-written agent mix
(``classifiers/data/agent_mix.jsonl``) measure the drafters and the router; nothing trained here may have seen
them or text made from them. The target writes many of its own prompts (:mod:`backends.corpus.synthesis`), and a
small model that has read these benchmarks may write one back, so every training prompt passes this filter: it is
dropped when it shares a run of ``NGRAM`` words with an evaluation prompt (GPT-3's contamination test uses 13),
or, for an evaluation prompt shorter than that, when it holds the whole of it (:data:`MIN_CONTAINED`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

from backends.default_model import REPO_ROOT

EVALUATION_PROMPTS = REPO_ROOT.parent / "shared" / "data" / "prompts"
"""The shared benchmark prompts (evaluation only), beside the checkout."""
AGENT_MIX = REPO_ROOT / "classifiers" / "data" / "agent_mix.jsonl"
"""The 160 hand-written agent requests: the router's unseen traffic, and evaluation only for the drafters."""
NGRAM = 13
MIN_CONTAINED = 6
"""An evaluation prompt shorter than NGRAM words but at least this long is matched wherever a text holds it;
a shorter one ("Hello") only by a text that is nothing else."""
_WORD = re.compile(r"[a-z0-9]+")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def evaluation_texts(prompts: Path = EVALUATION_PROMPTS, agent_mix: Path = AGENT_MIX) -> list[str]:
    """Every user or system turn of the evaluation sets that are present (the shared folder may be absent)."""
    texts = []
    for path in sorted(prompts.glob("*.jsonl")) if prompts.is_dir() else []:
        texts += [turn for line in _lines(path) for turn in json.loads(line).get("turns", [])]
    if agent_mix.is_file():
        for line in _lines(agent_mix):
            texts += [m["content"] for m in json.loads(line)["messages"] if isinstance(m.get("content"), str)]
    return texts


class EvaluationFilter:
    """Answers whether a text overlaps the evaluation prompts (see the module docstring)."""

    def __init__(self, texts: Iterable[str]) -> None:
        self.ngrams: set[tuple[str, ...]] = set()
        self.short: list[str] = []
        self.exact: set[str] = set()
        for text in texts:
            tokens = words(text)
            if len(tokens) >= NGRAM:
                self.ngrams.update(_ngrams(tokens))
            elif len(tokens) >= MIN_CONTAINED:
                self.short.append(" ".join(tokens))
            elif tokens:
                self.exact.add(" ".join(tokens))

    @classmethod
    def default(cls) -> EvaluationFilter:
        return cls(evaluation_texts())

    def leaks(self, text: str) -> bool:
        return self.overlaps(words(text))

    def overlaps(self, tokens: list[str]) -> bool:
        """:meth:`leaks` for a text already split by :func:`words`."""
        if any(gram in self.ngrams for gram in _ngrams(tokens)):
            return True
        joined = " ".join(tokens)
        return joined in self.exact or any(f" {short} " in f" {joined} " for short in self.short)


def _ngrams(tokens: list[str]) -> Iterable[tuple[str, ...]]:
    return (tuple(tokens[i : i + NGRAM]) for i in range(len(tokens) - NGRAM + 1))


def _lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip()]

"""Drafting from a datastore of the target's own answers: the shipped corpus the drafter was trained on.

REST (He et al., arXiv 2311.08252) drafts from a large fixed datastore searched by the newest tokens. Ours holds the
target's own answers (``distill.jsonl.gz`` of the drafters' corpus: every prompt there was made here, none from an
evaluation set), so what it drafts is what this model writes, and where a request's answer runs like one of them (a
common code idiom, a stock phrase, a JSON frame) it drafts spans the traffic cache has not seen yet: the cold start.

It is read-only and public (the corpus ships with the drafters), so every tenant reads the same one and it tells
nobody anything about another's traffic. Drafts are made by the traffic cache's rules
(:func:`~backends.dspark.traffic.best_draft`); only the index differs, built for millions of tokens:

* **Index.** The answers end to end in one ``int32`` array; every position with at least ``MIN_MATCH`` tokens of its
  answer before it, sorted (stably) by the tokens before it, newest first, packed into one ``uint64`` key: a
  context's newest tokens find their occurrences as one range, by binary search (``numpy.searchsorted``). 16 bytes a
  token, where the traffic cache's Python index costs about 100 on such text.
* **Match.** At most :data:`SAMPLE` occurrences of the longest matching key, spread evenly over its range (sorted
  by the tokens before them, so the sample spans the contexts they follow), each extended backwards up to ``depth``
  tokens.
* **Disk.** Built once per corpus (about 5 s for the default drafters' 6 million tokens) into ``datastore/`` beside
  it, and memory-mapped from there, so a pool's processes (Redis workers, test runs) share one copy in the page cache.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import numpy as np

from backends.dspark.traffic import GAP, MAX_DRAFT, TrafficDraft, best_draft
from backends.traffic_settings import MIN_MATCH, TrafficOptions

CORPUS_DIR = "corpus"
"""The drafters' folder's shipped corpus (``train ship``): the prompts made here and the target's answers."""
ANSWERS_FILE = "distill.jsonl.gz"
"""The corpus file whose answers fill the datastore (the shipped stage file of the target's answers)."""
INDEX_DIR = "datastore"
"""Beside the corpus: the index built from it, with the hash of the answers it was built from."""
FORMAT = 1
SAMPLE = 64
"""Occurrences a draft weighs at most: a common key (a JSON quote) has thousands, and each costs the vote a pass."""
ARRAYS = ("tokens", "starts", "keys")
VOTES = 1
"""What the sampled occurrences' shares weigh against what datastore drafts earned in the pool
(:meth:`~backends.dspark.traffic.TrafficDraft.confidence`): one answer's worth, however many agree. They are other
prompts' answers, so their agreement says less about this request than the traffic's does about a template's next
one; counted in full, they drafted JSON frames and idioms where a copy from the context was the better block, and
an agent's schema and tool jobs ran 5-7% slower than without the datastore (even with it weighed as one: 0.95-1.01x,
against 1.13-1.45x on code, prose and JSON subtasks)."""


class Datastore:
    """The index over a fixed set of answers; read by every request of a pool, written by none."""

    def __init__(self, tokens: np.ndarray, starts: np.ndarray, keys: np.ndarray) -> None:
        # plain arrays over the same memory: a memmap's indexing and searchsorted pass through numpy's subclass
        # machinery, a third of a draft's time
        self._tokens, self._starts, self._keys = (np.asarray(array) for array in (tokens, starts, keys))
        self._bits = _bits(tokens)
        self._depth = min(64 // self._bits, 8)
        """Newest tokens a key holds (4 for a vocabulary under 65,535 ids)."""

    @classmethod
    def build(cls, answers: Iterable[list[int]]) -> Datastore:
        """The index of ``answers`` (those too short to match are left out), in memory."""
        pieces = [np.array([GAP, *answer], dtype=np.int32) for answer in answers if len(answer) > MIN_MATCH]
        tokens = np.concatenate([*pieces, np.array([GAP], dtype=np.int32)])
        bits = _bits(tokens)
        keys = np.zeros(len(tokens), dtype=np.uint64)
        usable = tokens != GAP
        for back in range(1, min(64 // bits, 8) + 1):
            before = np.full(len(tokens), GAP, dtype=np.int64)
            before[back:] = tokens[:-back]
            if back <= MIN_MATCH:
                usable &= before != GAP
            keys |= (before + 1).astype(np.uint64) << np.uint64(64 - back * bits)  # GAP as 0: sorts first
        positions = np.flatnonzero(usable)
        order = np.argsort(keys[positions], kind="stable")
        return cls(tokens, positions[order].astype(np.int32), keys[positions][order])

    @classmethod
    def open(cls, corpus: Path) -> Datastore | None:
        """The datastore of the corpus's answers, memory-mapped from its index (built and saved first where none
        matches the answers); None where the folder ships no answers."""
        answers = corpus / ANSWERS_FILE
        if not answers.is_file():
            return None
        stamp = f"{FORMAT}:{hashlib.sha256(answers.read_bytes()).hexdigest()}"
        index = corpus / INDEX_DIR
        if not (index / "stamp").is_file() or (index / "stamp").read_text() != stamp:
            with gzip.open(answers, "rt", encoding="utf-8") as lines:
                built = cls.build(json.loads(line)["completion"] for line in lines if line.strip())
            try:
                built.save(index, stamp)
            except OSError:  # a read-only install: this process keeps its own copy
                return built
        return cls(*(np.load(index / f"{name}.npy", mmap_mode="r") for name in ARRAYS))

    def save(self, index: Path, stamp: str) -> None:
        """The arrays into ``index``, replacing what was there whole (written aside, then moved in)."""
        index.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=index.parent, prefix=f".{index.name}-"))
        for name, array in zip(ARRAYS, (self._tokens, self._starts, self._keys)):
            np.save(staging / f"{name}.npy", array)
        (staging / "stamp").write_text(stamp)
        shutil.rmtree(index, ignore_errors=True)
        staging.rename(index)

    @property
    def tokens(self) -> int:
        return len(self._tokens)

    @property
    def memory_bytes(self) -> int:
        """The token array, the sorted positions and their keys (mapped: shared by the processes reading them)."""
        return self._tokens.nbytes + self._starts.nbytes + self._keys.nbytes

    def speculate(
        self, context: list[int], limit: int, options: TrafficOptions, forks: bool = False
    ) -> TrafficDraft | None:
        """The best draft of at most ``limit`` tokens after ``context`` (ending with the anchor), or None;
        ``forks``: with its other paths (for a token tree)."""
        if limit <= 0 or len(context) < MIN_MATCH:
            return None
        for n in range(min(self._depth, len(context)), MIN_MATCH - 1, -1):
            low, high = self._range(context[-n:])
            if high > low:
                break
        else:
            return None
        count = min(SAMPLE, high - low)  # evenly spread over the range, its ends included
        spread = low + np.arange(count, dtype=np.int64) * (high - 1 - low) // max(count - 1, 1)
        picked = np.sort(self._starts[spread])[::-1]  # the latest first: a tie goes to it, as in the traffic cache
        back, ahead = min(options.depth, len(context)), min(limit, MAX_DRAFT)
        around = np.clip(picked[:, None] + np.arange(-back, ahead), 0, len(self._tokens) - 1)  # both ends are GAP
        continuations: list[int] = []
        matches = []
        for row in self._tokens[around].tolist():
            match = min(n, back)
            while match < back and row[back - 1 - match] == context[-1 - match]:
                match += 1
            matches.append((match, len(continuations) + 1))
            continuations += [GAP, *row[back:]]
        draft = best_draft([*continuations, GAP], matches, limit, options, forks)
        if draft is None:
            return None
        others = tuple(replace(fork, votes=[VOTES] * len(fork.votes)) for fork in draft.forks)
        return replace(draft, votes=[VOTES] * len(draft.votes), forks=others)

    def _range(self, newest: list[int]) -> tuple[int, int]:
        """The range of sorted positions whose newest ``len(newest)`` tokens before them are ``newest``."""
        key = 0
        for back, token in enumerate(reversed(newest), start=1):
            key |= (token + 1) << (64 - back * self._bits)
        rest = 64 - len(newest) * self._bits
        low = np.searchsorted(self._keys, np.uint64(key), side="left")
        high = np.searchsorted(self._keys, np.uint64(key | ((1 << rest) - 1)), side="right")
        return int(low), int(high)


def _bits(tokens: np.ndarray) -> int:
    """Bits a key digit takes: every id plus one, and GAP's 0."""
    return (int(tokens.max(initial=0)) + 1).bit_length()

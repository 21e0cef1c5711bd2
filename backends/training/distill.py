"""Self-distillation: the frozen target's own answers to a list of prompts, made once and kept.

Drafts are verified against the target, so the target's outputs are exactly what a drafter has to predict. The
answers come from the project's own batched engine (:class:`~backends.autoregressive.AutoregressiveBackend`),
grammar and all: a subtask with a JSON schema or tools is answered under its constraint, as the DSpark pool
will serve it. Records are appended to a JSONL file as they finish, so an interrupted run resumes where it
stopped; the prompt token ids are the serving path's own (:func:`~backends.loading.prompt_ids`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from backends.autoregressive import AutoregressiveBackend
from backends.corpus.recipe import TrainingPrompt
from backends.engine import BatchLimits
from backends.errors import InvalidRequestError
from backends.loading import prompt_ids
from backends.progress import JobProgress


@dataclass(frozen=True)
class Distilled:
    index: int
    source: str
    prompt: list[int]
    completion: list[int]

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.completion

    @property
    def key(self) -> str:
        """The sequence's name in its corpus (its prompt's source and index), the same in every sample of it and
        in every session: what a drafter records as trained on."""
        return f"{self.source}#{self.index}"


def read_distilled(path: Path) -> list[Distilled]:
    """The records of ``path`` in prompt order (a record cut short by an interrupted write is dropped)."""
    records = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                record = Distilled(**json.loads(line))
            except (json.JSONDecodeError, TypeError):
                continue
            records[record.index] = record
    return [records[i] for i in sorted(records)]


Answers = Callable[[list[TrainingPrompt], list[int]], Iterator["Distilled | None"]]
"""How a corpus is answered: given the prompts and the indices still to answer, a record for each as it ends (None
for one the engine refuses). :func:`engine_answers` on a CPU, :func:`backends.training.bulk.bulk_answers` on a
GPU."""


def engine_answers(backend: AutoregressiveBackend, batch: int = 32) -> Answers:
    """The serving engine's answers, ``batch`` requests at a time: exactly what the pool would decode. A prompt
    the engine refuses (one too long for the model's context with its ``max_tokens``) has no record."""

    def answer(prompts: list[TrainingPrompt], index: int) -> Distilled | None:
        request = prompts[index].request
        try:
            ids = prompt_ids(backend.loaded, request)
        except InvalidRequestError:
            return None
        result = backend.complete(request)
        return Distilled(index, prompts[index].source, ids, list(result.token_ids))

    def answers(prompts: list[TrainingPrompt], todo: list[int]) -> Iterator[Distilled | None]:
        with ThreadPoolExecutor(batch) as pool:
            for future in as_completed([pool.submit(answer, prompts, i) for i in todo]):
                yield future.result()

    return answers


def distill(answers: Answers, prompts: list[TrainingPrompt], path: Path) -> list[Distilled]:
    """Answer every prompt not yet in ``path``, appending each record as it ends; the records in prompt order
    (the caller sees a refused prompt by the index it lacks)."""
    done = {record.index for record in read_distilled(path)}
    todo = [i for i in range(len(prompts)) if i not in done]
    path.parent.mkdir(parents=True, exist_ok=True)
    with JobProgress(log_every=100) as progress, path.open("a") as out:
        task = progress.add_job("self-distillation", total=len(prompts), completed=len(done))
        tokens = 0
        for record in answers(prompts, todo):
            if record is not None:
                out.write(json.dumps(record.__dict__) + "\n")
                out.flush()
                tokens += len(record.completion)
            progress.step(task, status=f"{tokens} tokens")
    return read_distilled(path)


def distillation_backend(target: Path, dtype: str, batch: int, device: str = "cpu") -> AutoregressiveBackend:
    limits = BatchLimits(max_batch=batch)
    return AutoregressiveBackend.from_pretrained(target, device=device, dtype=dtype, limits=limits)

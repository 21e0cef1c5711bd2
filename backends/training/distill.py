"""Self-distillation data: the frozen target's own greedy answers to the prompt mix, made once and kept.

Drafts are verified against the target, so the target's outputs are exactly what a drafter has to predict. The
answers come from the project's own batched engine (:class:`~backends.autoregressive.AutoregressiveBackend`),
grammar and all: a subtask with a JSON schema or tools is answered under its constraint, as the DSpark pool
will serve it. Records are appended to a JSONL file as they finish, so an interrupted run resumes where it
stopped; the prompt token ids are the serving path's own (:func:`~backends.loading.prompt_ids`).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from backends.autoregressive import AutoregressiveBackend
from backends.engine import BatchLimits
from backends.loading import prompt_ids
from backends.progress import JobProgress
from backends.training.prompts import TrainingPrompt


@dataclass(frozen=True)
class Distilled:
    index: int
    source: str
    prompt: list[int]
    completion: list[int]

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.completion


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


def distill(
    backend: AutoregressiveBackend, prompts: list[TrainingPrompt], path: Path, batch: int = 32
) -> list[Distilled]:
    """Answer every prompt not yet in ``path``, ``batch`` at a time in the engine, appending each as it ends."""
    done = {record.index for record in read_distilled(path)}
    todo = [i for i in range(len(prompts)) if i not in done]
    path.parent.mkdir(parents=True, exist_ok=True)

    def answer(index: int) -> Distilled:
        request = prompts[index].request
        result = backend.complete(request)
        return Distilled(index, prompts[index].source, prompt_ids(backend.loaded, request), list(result.token_ids))

    with JobProgress(log_every=100) as progress, path.open("a") as out, ThreadPoolExecutor(batch) as pool:
        task = progress.add_job("self-distillation", total=len(prompts), completed=len(done))
        tokens = 0
        for future in as_completed([pool.submit(answer, i) for i in todo]):
            record = future.result()
            out.write(json.dumps(record.__dict__) + "\n")
            out.flush()
            tokens += len(record.completion)
            progress.step(task, status=f"{tokens} tokens")
    return read_distilled(path)


def distillation_backend(target: Path, dtype: str, batch: int) -> AutoregressiveBackend:
    return AutoregressiveBackend.from_pretrained(target, device="cpu", dtype=dtype, limits=BatchLimits(max_batch=batch))

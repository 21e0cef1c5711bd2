"""Tune a model's span thresholds for exact verification: the setting its pool starts with.

In exact mode the thresholds never change the output, only how much is drafted, so they can be chosen by
speed alone: every candidate decodes the same validation prompts (a seed the benchmark does not use), and
the fastest total wall time wins. What is cheap to verify differs by model and machine (on a small model
on CPU a 4-token pass costs about what a 1-token pass does; on a big model on a GPU it may not), which is why
this is measured rather than fixed.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

from backends.corpus.subtasks import generate_subtasks
from backends.dspark.backend import DSparkBackend
from backends.progress import JobProgress
from backends.types import GenerationRequest

VALIDATION_SEED = 8_001
GRID_2 = (0.0, 0.3, 0.6)
GRID_4 = (0.0, 0.3, 0.6, 0.85)


def validation_requests(count: int, max_tokens: int) -> list[GenerationRequest]:
    return [
        GenerationRequest(**{**subtask.to_request_dict(), "max_tokens": max_tokens, "temperature": 0.0})
        for subtask in generate_subtasks(count, seed=VALIDATION_SEED)
    ]


def tune_thresholds(backend: DSparkBackend, requests: list[GenerationRequest]) -> tuple[dict[int, float], list[dict]]:
    """The fastest thresholds over ``requests`` and every candidate's timing (best of two passes each)."""
    candidates = [{2: t2, 4: t4} for t2, t4 in itertools.product(GRID_2, GRID_4) if t4 >= t2]
    timings = []
    with JobProgress(log_every=1) as progress:
        task = progress.add_job("tune thresholds", total=len(candidates))
        for thresholds in candidates:
            trial = DSparkBackend(backend.model, replace(backend.policy, thresholds=thresholds, verification="exact"))
            trial.complete(requests[0])
            seconds = min(sum(trial.complete(r).stats.wall_time_s for r in requests) for _ in range(2))
            timings.append({"thresholds": thresholds, "seconds": seconds})
            progress.step(task, status=f"{thresholds} {seconds:.2f}s")
    best = min(timings, key=lambda t: t["seconds"])
    return best["thresholds"], timings

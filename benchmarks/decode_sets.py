"""The prompt sets of ``bench decode``: held-out chat subtasks by category, and folders of real benchmark
prompts in the shared format (one JSON object a line, ``turns[0]`` the user message).

The held-out subtasks use a seed the drafters' training never used, and are sent as an agent sends them (with
their response format and tools); the shared prompts are evaluation only, and nothing in the benchmark fits
anything on them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from backends.corpus.subtasks import generate_subtasks
from backends.types import GenerationRequest

HELD_OUT_SEED = 9_001
CATEGORIES: dict[str, tuple[tuple[str, ...], float]] = {
    "code": (("code_completion", "code_edit"), 0.0),
    "json": (("json_extraction", "tool_call_arguments"), 0.0),
    "extraction": (("qa_context", "classification", "rewriting"), 0.0),
    "prose": (("creative_writing", "brainstorming", "open_chat", "summarisation"), 0.0),
    "prose_t0.8": (("creative_writing", "brainstorming", "open_chat", "summarisation"), 0.8),
}


@dataclass
class PromptSet:
    name: str
    temperature: float
    requests: list[GenerationRequest]


def held_out_sets(per_category: int, max_tokens: int) -> list[PromptSet]:
    sets = []
    for name, (kinds, temperature) in CATEGORIES.items():
        subtasks = generate_subtasks(per_category, seed=HELD_OUT_SEED, kinds=kinds)
        requests = [
            GenerationRequest(
                **{**s.to_request_dict(), "max_tokens": max_tokens, "temperature": temperature, "top_p": 1.0, "seed": i}
            )
            for i, s in enumerate(subtasks)
        ]
        sets.append(PromptSet(name, temperature, requests))
    return sets


def shared_sets(
    folder: Path, per_set: int, max_tokens: int, temperatures: list[float], sampled: set[str] | None = None
) -> list[PromptSet]:
    """The first ``per_set`` rows of each ``*.jsonl`` in ``folder`` as single-turn chats; a set at temperature
    t > 0 is named ``NAME_tT``, and runs only for the sets in ``sampled`` when it is given."""
    sets = []
    for file in sorted(folder.glob("*.jsonl")):
        rows = [json.loads(line) for line in file.read_text().splitlines() if line.strip()][:per_set]
        for temperature in temperatures:
            if temperature > 0 and sampled is not None and file.stem not in sampled:
                continue
            requests = [
                GenerationRequest(
                    messages=[{"role": "user", "content": row["turns"][0]}],
                    max_tokens=max_tokens,
                    temperature=temperature,
                    seed=i,
                )
                for i, row in enumerate(rows)
            ]
            name = file.stem if temperature == 0 else f"{file.stem}_t{temperature:g}"
            sets.append(PromptSet(name, temperature, requests))
    return sets

"""``dspark-router bench quality``: does the model answer, or only produce the shape of an answer?

Speed is only worth having on answers that are right. This runs held-out subtasks of every kind (a seed the
training corpus never used, see :data:`HELD_OUT_SEED`) through the autoregressive backend (DSpark exact gives
the same greedy output, so answer quality is the model's) and scores them against the generator's references:

* deterministic kinds: exact answers per kind; JSON field accuracy of extractions; the share of code outputs
  that parse with :func:`ast.parse` (a completion together with the code it completes); the share of tool calls
  whose arguments validate against the tool's schema and equal the reference;
* open-ended kinds, which have no single right answer: distinct-1/2 (unique word n-grams over all n-grams of
  the kind's outputs: a model stuck in a loop scores low) and the share of outputs that end properly (EOS or a
  stop string, not ``max_tokens``).

Both greedy and sampled at temperature 0.7 (seeded per subtask), since agents send both.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema

from backends.autoregressive import AutoregressiveBackend
from backends.corpus.subtasks import KINDS, OPEN_ENDED_KINDS, Subtask, generate_subtasks
from backends.default_model import DEFAULT_MODEL
from backends.progress import JobProgress
from backends.types import GenerationRequest, GenerationResult
from benchmarks.output import write_json

HELD_OUT_SEED = 4_242
MODES = {"greedy": 0.0, "t0.7": 0.7}
CODE_KINDS = ("code_completion", "code_edit")
FENCE = re.compile(r"^\s*```[\w-]*\s*$", re.MULTILINE)
FENCED_BLOCK = re.compile(r"```[\w-]*\n(.*?)\n```", re.DOTALL)
# Targets of the issue that asked for this benchmark (greedy, held-out seeds).
TARGETS = {"exact_overall": 0.7, "exact_every_kind": 0.5, "json_fields": 0.9, "code_parses": 0.9, "tool_args": 0.8}


def _strip_fences(text: str) -> str:
    return FENCE.sub("", text).strip("\n")


def _completed_code(subtask: Subtask, output: str) -> str:
    """The code a completion finishes, then the output: the prompt's fenced block, else the prompt from its first
    ``def``/``class`` line (the instruction comes before or after the code, depending on the template)."""
    prompt = subtask.messages[-1]["content"]
    fenced = FENCED_BLOCK.search(prompt)
    start = re.search(r"^(def |class )", prompt, re.MULTILINE)
    head = fenced.group(1) if fenced else prompt[start.start() :] if start else prompt
    return f"{head}\n{_strip_fences(output)}"


def code_parses(subtask: Subtask, output: str) -> bool:
    code = _completed_code(subtask, output) if subtask.kind == "code_completion" else _strip_fences(output)
    try:
        ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    return True


def json_fields(reference: str, output: str) -> tuple[int, int]:
    """(fields right, fields asked): a field is right when the output's JSON object has the reference's value."""
    expected = json.loads(reference)
    try:
        answer = json.loads(output)
    except json.JSONDecodeError:
        answer = None
    if not isinstance(answer, dict):
        return 0, len(expected)
    return sum(answer.get(key, object()) == value for key, value in expected.items()), len(expected)


def tool_call_right(subtask: Subtask, tool_calls: list[dict] | None) -> bool:
    """One call of the reference's tool, whose arguments validate against that tool's schema and equal the
    reference's."""
    expected = json.loads(subtask.reference)
    if not tool_calls or len(tool_calls) != 1:
        return False
    function = tool_calls[0].get("function", {})
    try:
        arguments = json.loads(function.get("arguments", ""))
    except json.JSONDecodeError:
        return False
    schemas = {t["function"]["name"]: t["function"].get("parameters", {}) for t in subtask.tools or []}
    if function.get("name") != expected["name"] or function["name"] not in schemas:
        return False
    try:
        jsonschema.validate(arguments, schemas[function["name"]])
    except jsonschema.ValidationError:
        return False
    return arguments == expected["arguments"]


def distinct_n(outputs: Iterable[str], n: int) -> float:
    grams = [tuple(words[i : i + n]) for words in (o.split() for o in outputs) for i in range(len(words) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


@dataclass
class KindScore:
    """What one kind's outputs earned; the fields that do not apply to the kind stay at zero counts."""

    count: int = 0
    exact: int = 0
    json_right: int = 0
    json_asked: int = 0
    parsed: int = 0
    tools_right: int = 0
    ended: int = 0
    outputs: list[str] = field(default_factory=list)

    def add(self, subtask: Subtask, result: GenerationResult) -> None:
        self.count += 1
        self.outputs.append(result.text)
        self.ended += result.finish_reason != "length"
        if subtask.open_ended:
            return
        self.exact += result.text.strip() == subtask.reference.strip()
        if subtask.kind == "json_extraction":
            right, asked = json_fields(subtask.reference, result.text)
            self.json_right, self.json_asked = self.json_right + right, self.json_asked + asked
        if subtask.kind in CODE_KINDS:
            self.parsed += code_parses(subtask, result.text)
        if subtask.kind == "tool_call_arguments":
            self.tools_right += tool_call_right(subtask, result.tool_calls)

    def report(self, kind: str) -> dict[str, float | int]:
        share = {"count": self.count, "ended": self.ended / self.count}
        if kind in OPEN_ENDED_KINDS:
            return {**share, "distinct_1": distinct_n(self.outputs, 1), "distinct_2": distinct_n(self.outputs, 2)}
        share["exact"] = self.exact / self.count
        if self.json_asked:
            share["json_fields"] = self.json_right / self.json_asked
        if kind in CODE_KINDS:
            share["code_parses"] = self.parsed / self.count
        if kind == "tool_call_arguments":
            share["tool_args"] = self.tools_right / self.count
        return share


def summarise(scores: dict[str, KindScore]) -> dict[str, float | None]:
    """Overall shares, pooled over subtasks (every kind has the same count, so pooling weighs kinds equally)."""
    closed = {kind: s for kind, s in scores.items() if kind not in OPEN_ENDED_KINDS}
    code = [scores[k] for k in CODE_KINDS if k in scores]
    tools = scores.get("tool_call_arguments")
    extraction = scores.get("json_extraction")

    def ratio(part: int, whole: int) -> float | None:
        return part / whole if whole else None

    return {
        "exact_overall": ratio(sum(s.exact for s in closed.values()), sum(s.count for s in closed.values())),
        "exact_every_kind": min((s.exact / s.count for s in closed.values()), default=None),
        "json_fields": ratio(extraction.json_right, extraction.json_asked) if extraction else None,
        "code_parses": ratio(sum(s.parsed for s in code), sum(s.count for s in code)),
        "tool_args": ratio(tools.tools_right, tools.count) if tools else None,
    }


def request_for(subtask: Subtask, temperature: float, seed: int, max_tokens: int) -> GenerationRequest:
    args = subtask.to_request_dict()
    args.update(temperature=temperature, top_p=1.0, seed=seed, max_tokens=min(args["max_tokens"], max_tokens))
    return GenerationRequest(**args)


def run_benchmark(model: Path, per_kind: int, max_tokens: int, seed: int = HELD_OUT_SEED) -> dict:
    backend = AutoregressiveBackend.from_pretrained(model, device="cpu")
    subtasks = generate_subtasks(per_kind * len(KINDS), seed=seed)
    modes: dict[str, dict] = {}
    with JobProgress() as progress:
        job = progress.add_job("bench quality", total=len(subtasks) * len(MODES))
        for mode, temperature in MODES.items():
            scores = {kind: KindScore() for kind in KINDS}
            for i, subtask in enumerate(subtasks):
                scores[subtask.kind].add(subtask, backend.complete(request_for(subtask, temperature, i, max_tokens)))
                progress.step(job, status=mode)
            modes[mode] = {"kinds": {k: s.report(k) for k, s in scores.items()}, "overall": summarise(scores)}
    greedy = modes["greedy"]["overall"]
    targets = {name: greedy[name] is not None and greedy[name] >= floor for name, floor in TARGETS.items()}
    return {
        "model": str(model),
        "seed": seed,
        "per_kind": per_kind,
        "max_tokens": max_tokens,
        "modes": modes,
        "targets": {"floors": TARGETS, "met_greedy": targets},
    }


def print_table(report: dict) -> None:
    """One line per kind, both modes side by side, within 80 columns."""
    print(f"{'kind':<20} {'mode':<7} {'exact':>6} {'fields':>6} {'parse':>6} {'tools':>6} {'ended':>6} {'dist-2':>6}")
    for kind in KINDS:
        for mode, result in report["modes"].items():
            row = result["kinds"][kind]
            cells = [row.get(name) for name in ("exact", "json_fields", "code_parses", "tool_args", "ended")]
            cells.append(row.get("distinct_2"))
            text = " ".join(f"{c:>6.2f}" if c is not None else f"{'':>6}" for c in cells)
            print(f"{kind:<20} {mode:<7} {text}")
    for mode, result in report["modes"].items():
        overall = ", ".join(f"{k} {v:.2f}" for k, v in result["overall"].items() if v is not None)
        print(f"{mode}: {overall}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--per-kind", type=int, default=8, help="held-out subtasks per kind")
    parser.add_argument("--max-tokens", type=int, default=256, help="cap on each subtask's own max_tokens")
    parser.add_argument("--seed", type=int, default=HELD_OUT_SEED, help="subtask seed (never one trained on)")
    parser.add_argument("--json", type=Path, help="write the report here")


def run(args: argparse.Namespace) -> int:
    report = run_benchmark(args.model, args.per_kind, args.max_tokens, args.seed)
    print_table(report)
    write_json(args.json, report)
    return 0

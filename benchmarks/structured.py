"""``dspark-router bench structured``: one instance per real JSON schema, from each backend, validated.

For every schema: compile it (or count the clear refusal), then generate greedily and at temperature 0.8
with each backend under the schema, and validate every finished output with ``jsonschema``. ``invalid``
counts finished outputs that fail validation and must stay 0; outputs cut by ``max_tokens`` are counted
apart as ``truncated`` (a budget, not a grammar, ended them), and schemas whose prompt does not fit the
model's context with the token budget as ``prompt_too_long``. Greedy runs of both backends are timed side by
side for the DSpark speedup with constraints on.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import torch

from backends.autoregressive import AutoregressiveBackend
from backends.default_model import DEFAULT_MODEL
from backends.dspark.backend import DSparkBackend
from backends.errors import InvalidRequestError, UnsupportedFormatError
from backends.progress import JobProgress
from backends.types import GenerationRequest, GenerationResult
from benchmarks.output import write_json

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SCHEMAS = REPO.parent / "shared" / "data" / "jsonschemabench"

TEMPERATURES = (0.0, 0.8)


@dataclass
class Outcome:
    valid: int = 0
    invalid: int = 0
    truncated: int = 0
    tokens: int = 0
    forced: int = 0
    constraint_s: float = 0.0
    greedy_s: float = 0.0
    greedy_tokens: int = 0

    def add(self, result: GenerationResult, schema: dict, greedy: bool) -> None:
        self.tokens += len(result.token_ids)
        self.forced += result.stats.forced_tokens
        self.constraint_s += result.stats.constraint_s
        if greedy:
            self.greedy_s += result.stats.wall_time_s
            self.greedy_tokens += len(result.token_ids)
        if result.finish_reason == "length":
            self.truncated += 1
            return
        try:
            jsonschema.validate(json.loads(result.text), schema)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            self.invalid += 1
        else:
            self.valid += 1

    def summary(self) -> dict:
        return {
            "valid": self.valid,
            "invalid": self.invalid,
            "truncated": self.truncated,
            "forced_token_share": self.forced / self.tokens if self.tokens else 0.0,
            "constraint_us_per_token": 1e6 * self.constraint_s / self.tokens if self.tokens else 0.0,
            "greedy_tokens_per_s": self.greedy_tokens / self.greedy_s if self.greedy_s else 0.0,
        }


def load_schemas(folder: Path, limit: int | None, seed: int) -> list[tuple[str, dict]]:
    files = sorted(folder.glob("*.json"))
    if limit is not None and limit < len(files):
        files = sorted(random.Random(seed).sample(files, limit))
    return [(f.stem, json.loads(f.read_text())) for f in files]


def request_for(entry: dict, temperature: float, max_tokens: int) -> GenerationRequest:
    description = entry.get("description") or "the record"
    return GenerationRequest(
        messages=[{"role": "user", "content": f"Give one JSON example of {description}"[:400]}],
        response_format={"type": "json_schema", "json_schema": {"name": "output", "schema": entry["schema"]}},
        temperature=temperature,
        seed=0,
        max_tokens=max_tokens,
    )


def run_benchmark(model: Path, schemas: list[tuple[str, dict]], which: str, max_tokens: int) -> dict:
    dspark = DSparkBackend.from_pretrained(model, device="cpu")
    backends = {"dspark": dspark, "ar": AutoregressiveBackend(dspark.loaded)}
    if which != "both":
        backends = {which: backends[which]}
    outcomes = {name: Outcome() for name in backends}
    compiled, too_long, refusals = 0, 0, {}
    with JobProgress(log_every=20) as progress:
        task = progress.add_job("bench structured", total=len(schemas))
        for name, entry in schemas:
            try:
                for temperature in TEMPERATURES:
                    request = request_for(entry, temperature, max_tokens)
                    for backend_name, backend in backends.items():
                        result = backend.complete(request)
                        outcomes[backend_name].add(result, entry["schema"], greedy=temperature == 0.0)
                compiled += 1
            except UnsupportedFormatError as exc:
                refusals[name] = exc.message[:160]
            except InvalidRequestError as exc:
                if exc.param != "max_tokens":
                    raise
                too_long += 1
            progress.step(task, status=f"compiled {compiled}")
    report = {
        "model": str(model),
        "schemas": len(schemas),
        "compiled": compiled,
        "refused": len(refusals),
        "prompt_too_long": too_long,
        "compiled_share": compiled / len(schemas) if schemas else 0.0,
        "max_tokens": max_tokens,
        "backends": {name: outcome.summary() for name, outcome in outcomes.items()},
        "refusals": refusals,
    }
    summaries = report["backends"]
    if "ar" in summaries and "dspark" in summaries and summaries["ar"]["greedy_tokens_per_s"]:
        report["dspark_speedup_constrained"] = (
            summaries["dspark"]["greedy_tokens_per_s"] / summaries["ar"]["greedy_tokens_per_s"]
        )
    report["invalid"] = sum(s["invalid"] for s in summaries.values())
    report["valid"] = sum(s["valid"] for s in summaries.values())
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--schemas", type=Path, default=DEFAULT_SCHEMAS, help="folder of JSONSchemaBench files")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--backend", choices=["dspark", "ar", "both"], default="both")
    parser.add_argument("--limit", type=int, default=None, help="a seeded sample of this many schemas")
    parser.add_argument("--max-tokens", type=int, default=384)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the report here")


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.schemas.is_dir():
        raise SystemExit(f"no schema folder at {args.schemas}")
    report = run_benchmark(args.model, load_schemas(args.schemas, args.limit, args.seed), args.backend, args.max_tokens)
    print(json.dumps(report, indent=2))
    write_json(args.json, report)
    return 0 if report["invalid"] == 0 else 1

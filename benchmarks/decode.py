"""``dspark-router bench decode``: DSpark against plain decoding and transformers' own fast paths, one run.

Every prompt is run by every contender back to back (interleaved, after a warm-up), on the same model and
the same thread count, so machine noise hits all of them alike and the speedups are ratios measured side by
side. Contenders: our autoregressive backend, DSpark exact and confidence, transformers greedy
``generate()``, prompt-lookup decoding and assisted generation with a smaller draft model.

Prompts are held-out chat subtasks (a seed the training corpus never used) in the categories the DSpark pool
is meant for (code, json, extraction) and the one it is not (prose, greedy and at temperature 0.8).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from backends.autoregressive import AutoregressiveBackend
from backends.dspark import DSparkBackend
from backends.dspark.corpus import iter_chat_prompts
from backends.loading import load_model, prompt_ids
from backends.progress import JobProgress
from backends.types import GenerationRequest

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "models" / "dspark-mini"
DEFAULT_DRAFT = Path(__file__).resolve().parents[1] / "models" / "dspark-mini-draft"
HELD_OUT_SEED = 9_001
CATEGORIES: dict[str, tuple[tuple[str, ...], float]] = {
    "code": (("code_completion", "code_edit"), 0.0),
    "json": (("json_extraction", "tool_call_arguments"), 0.0),
    "extraction": (("qa_context", "classification", "rewriting"), 0.0),
    "prose": (("creative_writing", "brainstorming", "open_chat", "summarisation"), 0.0),
    "prose_t0.8": (("creative_writing", "brainstorming", "open_chat", "summarisation"), 0.8),
}
CONTENDERS = ("ar", "dspark", "dspark_confidence", "hf_greedy", "hf_prompt_lookup", "hf_assisted")


@dataclass
class Tally:
    tokens: int = 0
    seconds: float = 0.0
    accepted: list[float] = field(default_factory=list)
    fallback: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


@dataclass
class Run:
    tokens: list[int]
    seconds: float
    mean_accepted: float | None = None
    fallback_rate: float | None = None


def suite(per_category: int, max_tokens: int) -> dict[str, list[GenerationRequest]]:
    out = {}
    for name, (kinds, temperature) in CATEGORIES.items():
        examples = iter_chat_prompts(per_category, seed=HELD_OUT_SEED, kinds=kinds)
        out[name] = [
            GenerationRequest(messages=ex.messages, max_tokens=max_tokens, temperature=temperature, seed=i)
            for i, ex in enumerate(examples)
        ]
    return out


class Contenders:
    """Each contender as a function request -> Run, all sharing one loaded base model."""

    def __init__(self, model_path: Path, draft_path: Path | None) -> None:
        self.dspark = DSparkBackend.from_pretrained(model_path, device="cpu")
        self.confidence = DSparkBackend(self.dspark.model, replace(self.dspark.policy, verification="confidence"))
        self.ar = AutoregressiveBackend(self.dspark.loaded)
        self.draft = load_model(draft_path, device="cpu").model if draft_path and draft_path.is_dir() else None

    def runners(self) -> dict[str, Callable[[GenerationRequest], Run]]:
        runners = {
            "ar": lambda r: self._local(self.ar, r),
            "dspark": lambda r: self._local(self.dspark, r),
            "dspark_confidence": lambda r: self._local(self.confidence, r),
            "hf_greedy": lambda r: self._hf(r),
            "hf_prompt_lookup": lambda r: self._hf(r, prompt_lookup_num_tokens=10),
        }
        if self.draft is not None:
            runners["hf_assisted"] = lambda r: self._hf(r, assistant_model=self.draft)
        return runners

    @staticmethod
    def _local(backend, request: GenerationRequest) -> Run:
        result = backend.complete(request)
        spans = result.stats.spans
        return Run(
            tokens=result.token_ids,
            seconds=result.stats.wall_time_s,
            mean_accepted=spans.mean_accepted if spans else None,
            fallback_rate=spans.fallback_rate if spans else None,
        )

    def _hf(self, request: GenerationRequest, **options) -> Run:
        loaded = self.dspark.loaded
        ids = torch.tensor([prompt_ids(loaded, request)])
        sampling = (
            {"do_sample": True, "temperature": request.temperature} if not request.greedy else {"do_sample": False}
        )
        if not request.greedy:
            torch.manual_seed(request.seed or 0)
        started = time.perf_counter()
        out = loaded.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=request.max_tokens,
            eos_token_id=sorted(loaded.eos_ids),
            pad_token_id=loaded.tokenizer.pad_token_id,
            **sampling,
            **options,
        )
        seconds = time.perf_counter() - started
        tokens = out[0, ids.shape[1] :].tolist()
        return Run(tokens=[t for t in tokens if t not in loaded.eos_ids], seconds=seconds)


def agreement(reference: list[int], other: list[int]) -> float:
    """Share of the reference's tokens that the other output reproduces before they first differ."""
    same = next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b), min(len(reference), len(other)))
    return same / len(reference) if reference else 1.0


def run_benchmark(model: Path, draft: Path | None, per_category: int, max_tokens: int) -> dict:
    torch.manual_seed(0)
    contenders = Contenders(model, draft)
    runners = contenders.runners()
    prompts = suite(per_category, max_tokens)
    warm = prompts["code"][0].model_copy(update={"max_tokens": 8})
    for run in runners.values():
        run(warm)
    categories, mismatches = {}, 0
    total = sum(map(len, prompts.values()))
    with JobProgress(log_every=5) as progress:
        task = progress.add_job("bench decode", total=total)
        for name, requests in prompts.items():
            tallies = {c: Tally() for c in runners}
            agreements = []
            for request in requests:
                runs = {c: run(request) for c, run in runners.items()}
                for c, r in runs.items():
                    tallies[c].tokens += len(r.tokens)
                    tallies[c].seconds += r.seconds
                    if r.mean_accepted is not None:
                        tallies[c].accepted.append(r.mean_accepted)
                        tallies[c].fallback.append(r.fallback_rate)
                if request.greedy:
                    mismatches += runs["dspark"].tokens != runs["ar"].tokens
                    agreements.append(agreement(runs["ar"].tokens, runs["dspark_confidence"].tokens))
                progress.step(task, status=name)
            categories[name] = _summary(tallies, agreements)
    return {
        "model": str(model),
        "draft_model": str(draft) if contenders.draft is not None else None,
        "prompts": total,
        "max_tokens": max_tokens,
        "threads": torch.get_num_threads(),
        "lossless_mismatches": mismatches,
        "categories": categories,
    }


def _summary(tallies: dict[str, Tally], agreements: list[float]) -> dict:
    ar, dspark, confidence = tallies["ar"], tallies["dspark"], tallies["dspark_confidence"]
    summary = {
        "ar_tokens_per_s": ar.tokens_per_s,
        "dspark_tokens_per_s": dspark.tokens_per_s,
        "speedup": dspark.tokens_per_s / ar.tokens_per_s,
        "mean_accepted": sum(dspark.accepted) / len(dspark.accepted),
        "fallback_rate": sum(dspark.fallback) / len(dspark.fallback),
        "confidence_mode_speedup": confidence.tokens_per_s / ar.tokens_per_s,
        "confidence_mode_token_agreement": sum(agreements) / len(agreements) if agreements else None,
    }
    for name in ("hf_greedy", "hf_prompt_lookup", "hf_assisted"):
        summary[f"{name}_tokens_per_s"] = tallies[name].tokens_per_s if name in tallies else None
    return summary


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["categories"])
    keys = [
        ("ar_tokens_per_s", "own AR"),
        ("dspark_tokens_per_s", "DSpark exact"),
        ("hf_greedy_tokens_per_s", "HF greedy"),
        ("hf_prompt_lookup_tokens_per_s", "HF prompt lookup"),
        ("hf_assisted_tokens_per_s", "HF assisted"),
    ]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(keys)
    for i, (key, label) in enumerate(keys):
        values = [report["categories"][n][key] or 0.0 for n in names]
        ax.bar([x + i * width for x in range(len(names))], values, width, label=label)
    ax.set_xticks([x + width * (len(keys) - 1) / 2 for x in range(len(names))], names)
    ax.set_ylabel("tokens / s")
    ax.set_title(f"bench decode: {Path(report['model']).name}, {report['prompts']} prompts")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--draft-model", type=Path, default=DEFAULT_DRAFT, help="draft for HF assisted generation")
    parser.add_argument("--quick", action="store_true", help="2 prompts per category, 48 tokens (under a minute)")
    parser.add_argument("--per-category", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--plot", type=Path, help="draw tokens/s per contender and category to this PNG")


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    per_category, max_tokens = (2, 48) if args.quick else (args.per_category, args.max_tokens)
    report = run_benchmark(args.model, args.draft_model, per_category, max_tokens)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    if args.plot:
        plot(report, args.plot)
    return 0

"""``dspark-router bench decode``: DSpark with each drafter against plain decoding and transformers' own fast
paths, one run.

Every prompt is run by every contender back to back (interleaved, after a warm-up), on the same model and
the same thread count, so machine noise hits all of them alike and the speedups are ratios measured side by
side. Contenders: our autoregressive backend, transformers greedy ``generate()`` and prompt-lookup decoding
(``prompt_lookup_num_tokens``) on the float32 reference, llama.cpp on the same GGUF, plain and with its own
prompt lookup (:mod:`benchmarks.llama_cpp_peer`, where ``llama-cpp-python`` is installed), and the DSpark pool's
variants (:data:`VARIANTS`: span heads, the published
drafter, that drafter with copied blocks beside it, copied blocks alone), exact; with ``--confidence-mode`` also
heads and drafter committing their drafts unverified. (Assisted generation needs a smaller model on the target's
tokenizer; SmolLM2-135M is the smallest of its family, so there is none to run.)

Prompt sets: held-out chat subtasks (a seed the training corpus never used) in the categories the DSpark pool
is meant for (code, json, extraction) and the one it is not (prose, greedy and at temperature 0.8); and with
``--prompts DIR`` every ``*.jsonl`` of that folder (the shared format: ``turns[0]`` is the user message), at
each of ``--temperatures``. The shared prompts are evaluation only: nothing here fits anything on them.

Per set and drafter: tokens/s and speedups, mean accepted length per round (bonus token included, as the
paper counts it), conditional acceptance by block position, the mean verification length chosen, and lossless
mismatches (greedy DSpark exact against greedy AR, which must be 0). On greedy sets a teacher-forced probe
(``decode_probe``) adds the static-threshold sweep and the confidence reliability.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from itertools import zip_longest
from pathlib import Path
from typing import Any

import torch

from backends.autoregressive import AutoregressiveBackend
from backends.default_model import DEFAULT_MODEL, drafters_for
from backends.dspark.backend import DSparkBackend
from backends.dspark.drafter_config import DRAFTER_DIR, is_drafter_dir
from backends.dspark.heads import CONFIG_FILE as HEADS_CONFIG_FILE
from backends.dspark.profile import measure_round
from backends.loading import LoadedModel, prompt_ids
from backends.precision import cpu_chip
from backends.progress import JobProgress
from backends.training.drafter import REPORT_FILE as TRAIN_REPORT_FILE
from backends.types import DSparkOptions, GenerationRequest, SpanStats
from benchmarks import decode_plots, decode_probe
from benchmarks.decode_sets import PromptSet, held_out_sets, shared_sets
from benchmarks.decode_ties import Tie, find_tie
from benchmarks.llama_cpp_peer import LlamaCppPeer, gguf_for
from benchmarks.output import write_json, write_plots

DRAFTERS = ("heads", "dspark")
VARIANTS: dict[str, tuple[str, DSparkOptions]] = {
    "heads": ("heads", DSparkOptions(drafter="heads")),
    "dspark": ("dspark", DSparkOptions(drafter="dspark", lookup="off")),
    "hybrid": ("dspark", DSparkOptions(drafter="dspark", lookup="beside")),
    "lookup": ("dspark", DSparkOptions(drafter="dspark", lookup="only")),
}
"""Each decoding variant of the DSpark pool, with the trained drafter it needs: span heads; the published drafter;
that drafter with blocks copied from the context beside its own (``hybrid``); and copied blocks alone (``lookup``,
n-gram lookup verified in the same loop, which needs no training)."""


@dataclass
class Run:
    """One contender's answer to one prompt. ``committed`` and ``forwards`` are counted where a peer drafts (its
    tokens, the end-of-sequence token included, and the target's forwards, the prompt's included), to set its
    tokens per verifying forward beside our rounds'."""

    tokens: list[int]
    seconds: float
    spans: SpanStats | None = None
    committed: int | None = None
    forwards: int | None = None


def hf_generate(loaded: LoadedModel, prompt: list[int], request: GenerationRequest, **options: Any) -> Run:
    """transformers' ``generate`` from ``prompt`` ids (``options``: its fast paths, such as prompt lookup), every
    forward of the model counted."""
    ids = torch.tensor([prompt])
    sampling = {"do_sample": True, "temperature": request.temperature} if not request.greedy else {"do_sample": False}
    if not request.greedy:
        torch.manual_seed(request.seed or 0)
    forwards = []
    counter = loaded.model.register_forward_pre_hook(lambda *_: forwards.append(1))
    started = time.perf_counter()
    try:
        out = loaded.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=request.max_tokens,
            eos_token_id=sorted(loaded.eos_ids),
            pad_token_id=loaded.tokenizer.pad_token_id,
            **sampling,
            **options,
        )
    finally:
        counter.remove()
    seconds = time.perf_counter() - started
    tokens = out[0, ids.shape[1] :].tolist()
    kept = [t for t in tokens if t not in loaded.eos_ids]
    return Run(tokens=kept, seconds=seconds, committed=len(tokens), forwards=len(forwards))


@dataclass
class Tally:
    """One contender on one set: time and tokens, and DSpark's round counts pooled over the set's prompts."""

    tokens: int = 0
    seconds: float = 0.0
    rounds: int = 0
    committed: int = 0
    verified: int = 0
    fallback: int = 0
    reached: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    peer_tokens: int = 0
    peer_forwards: int = 0

    def add(self, run: Run) -> None:
        self.tokens += len(run.tokens)
        self.seconds += run.seconds
        if run.committed is not None and run.forwards is not None:
            # the prompt's forward commits the first token; every later one is a verifying forward
            self.peer_tokens += run.committed - 1
            self.peer_forwards += run.forwards - 1
        spans = run.spans
        if spans is None:
            return
        self.rounds += spans.steps
        self.committed += sum(n * count for n, count in spans.accepted_span_hist.items())
        self.verified += sum((n - 1) * count for n, count in spans.proposed_span_hist.items())
        self.fallback += spans.fallback_steps
        self.reached = _add_lists(self.reached, spans.reached_by_offset)
        self.accepted = _add_lists(self.accepted, spans.accepted_by_offset)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_forward(self) -> float | None:
        """A drafting peer's tokens committed per verifying forward (None where none was counted): what our
        rounds' ``mean_accepted`` counts, bonus token included."""
        return self.peer_tokens / self.peer_forwards if self.peer_forwards else None

    def drafter_summary(self) -> dict:
        """Per-round means over every round of the set (None where no round ran)."""
        rounds = self.rounds
        return {
            "mean_accepted": self.committed / rounds if rounds else None,
            "mean_verified": self.verified / rounds if rounds else None,
            "fallback_rate": self.fallback / rounds if rounds else None,
            "conditional_acceptance": [a / r if r else None for a, r in zip(self.accepted, self.reached)],
        }


def _add_lists(total: list[int], more: list[int]) -> list[int]:
    return [a + b for a, b in zip_longest(total, more, fillvalue=0)]


def available_drafters(folder: Path) -> list[str]:
    """The drafters a folder carries: span heads (``dspark_config.json``), the published drafter
    (``dspark_drafter/``, or the folder itself)."""
    found = {
        "heads": (folder / HEADS_CONFIG_FILE).is_file(),
        "dspark": is_drafter_dir(folder) or is_drafter_dir(folder / DRAFTER_DIR),
    }
    return [d for d in DRAFTERS if found[d]]


class Contenders:
    """Each contender as a function request -> Run, all sharing one loaded base model. Every DSpark variant drafts
    from its own earlier answers (a traffic cache scope of its own): each prompt is run by every variant in turn, and
    a shared cache would hand the later ones the earlier ones' answer to the very prompt they decode."""

    def __init__(
        self,
        model_path: Path,
        drafters_path: Path,
        variants: list[str],
        dtype: str = "auto",
        confidence_mode: bool = False,
        gguf: Path | None = None,
        device: str = "cpu",
    ) -> None:
        self.variants = variants
        self.drafters = [d for d in DRAFTERS if any(VARIANTS[v][0] == d for v in variants)]
        self.confidence_mode = confidence_mode
        self.dspark = DSparkBackend.from_pretrained(
            model_path, device=device, dtype=dtype, drafter=self.drafters[0], drafter_path=drafters_path
        )
        self.ar = AutoregressiveBackend(self.dspark.loaded)
        eos = self.dspark.loaded.eos_ids
        self.llama_cpp = {
            name: LlamaCppPeer(gguf, eos, lookup)
            for name, lookup in (("llama_cpp", False), ("llama_cpp_lookup", True))
            if gguf is not None
        }

    def runners(self) -> dict[str, Callable[[GenerationRequest], Run]]:
        runners = {
            "ar": lambda r: self._local(self.ar, r),
            "hf_greedy": lambda r: self._hf(r),
            "hf_prompt_lookup": lambda r: self._hf(r, prompt_lookup_num_tokens=10),
        }
        for name, peer in self.llama_cpp.items():
            runners[name] = lambda r, peer=peer: self._llama_cpp(peer, r)
        for variant in self.variants:
            options = VARIANTS[variant][1]
            modes = [("", options)]
            if self.confidence_mode and variant in DRAFTERS:
                modes.append(("_confidence", options.model_copy(update={"verification": "confidence"})))
            for suffix, chosen in modes:
                name = f"dspark_{variant}{suffix}"
                runners[name] = lambda r, o=chosen, scope=name: self._local(
                    self.dspark, r.model_copy(update={"dspark": o, "cache_scope": r.cache_scope or scope})
                )
        return runners

    @staticmethod
    def _local(backend, request: GenerationRequest) -> Run:
        result = backend.complete(request)
        return Run(tokens=result.token_ids, seconds=result.stats.wall_time_s, spans=result.stats.spans)

    def _llama_cpp(self, peer: LlamaCppPeer, request: GenerationRequest) -> Run:
        """llama.cpp from the same chat-templated ids."""
        answer = peer.run(prompt_ids(self.dspark.loaded, request), request)
        return Run(answer.tokens, answer.seconds, committed=answer.committed, forwards=answer.forwards)

    def _hf(self, request: GenerationRequest, **options) -> Run:
        """transformers' ``generate`` on the float32 reference, in this thread (its OpenMP team does not reach the
        packed engine's threads)."""
        return hf_generate(self.dspark.loaded, prompt_ids(self.dspark.loaded, request), request, **options)

    def probe(self, drafter: str, request: GenerationRequest, reference: list[int]) -> decode_probe.ProbeRows:
        """The teacher-forced probe of ``drafter`` on the prompt of ``request`` and its greedy reference."""
        prompt = prompt_ids(self.dspark.loaded, request)
        sequence = [*prompt, *reference]
        if drafter == "heads":
            width = self.dspark.policy.longest - 1
            return decode_probe.probe_heads(self.dspark.model, sequence, len(prompt), width)
        return decode_probe.probe_dspark(self.dspark.loaded, self.dspark.drafter, sequence, len(prompt))

    def ties(self, prompt_set: PromptSet, runs: list[dict[str, Run]], variants: list[str]) -> dict[str, list[Tie]]:
        """Per variant, the cause of each greedy output that left the autoregressive one (:mod:`decode_ties`)."""
        loaded, found = self.dspark.loaded, {}
        for request, run in zip(prompt_set.requests, runs):
            prompt = prompt_ids(loaded, request)
            for variant in variants:
                reference, other = run["ar"].tokens, run[f"dspark_{variant}"].tokens
                if reference != other:
                    found.setdefault(variant, []).append(find_tie(loaded, prompt, reference, other))
        return found

    def round_costs(self) -> dict[str, float] | None:
        """Where a published-drafter round's time goes on this machine (the target's step and verification, the
        drafter's parts), to read the speedups against; None without that drafter."""
        if "dspark" not in self.drafters:
            return None
        return asdict(measure_round(self.dspark.loaded, self.dspark.drafter, repeats=20))

    def verified_at(self, drafter: str) -> decode_probe.VerifiedAt:
        if drafter == "heads":
            return lambda threshold, scores: decode_probe.heads_verified(self.dspark.policy, threshold, scores)
        return decode_probe.dspark_verified


def drafter_training_report(folder: Path) -> dict | None:
    """The published drafter's own held-out numbers from training (ECE before and after calibration, acceptance
    by position), to read beside the ones measured here; None when the folder has no training report."""
    file = (folder if is_drafter_dir(folder) else folder / DRAFTER_DIR) / TRAIN_REPORT_FILE
    return json.loads(file.read_text()) if file.is_file() else None


def agreement(reference: list[int], other: list[int]) -> float:
    """Share of the reference's tokens that the other output reproduces before they first differ."""
    same = next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b), min(len(reference), len(other)))
    return same / len(reference) if reference else 1.0


def set_summary(
    prompt_set: PromptSet,
    tallies: dict[str, Tally],
    runs: list[dict[str, Run]],
    variants: list[str],
    ties: dict[str, list[Tie]],
) -> dict:
    ar, hf = tallies["ar"].tokens_per_s, tallies["hf_greedy"].tokens_per_s
    llama_cpp = tallies["llama_cpp"].tokens_per_s if "llama_cpp" in tallies else None
    summary = {
        "temperature": prompt_set.temperature,
        "prompts": len(prompt_set.requests),
        "tokens_per_s": {name: tally.tokens_per_s for name, tally in tallies.items()},
        "peer_tokens_per_forward": {
            name: tally.tokens_per_forward for name, tally in tallies.items() if tally.tokens_per_forward is not None
        },
        "ar_vs_llama_cpp": ar / llama_cpp if llama_cpp else None,
        "drafters": {},
    }
    greedy = prompt_set.temperature == 0
    for variant in variants:
        exact = tallies[f"dspark_{variant}"]
        confidence = tallies.get(f"dspark_{variant}_confidence")
        mismatches = sum(r[f"dspark_{variant}"].tokens != r["ar"].tokens for r in runs)
        entry = {
            "tokens_per_s": exact.tokens_per_s,
            "speedup": exact.tokens_per_s / ar if ar else None,
            "speedup_vs_hf_greedy": exact.tokens_per_s / hf if hf else None,
            "speedup_vs_llama_cpp": exact.tokens_per_s / llama_cpp if llama_cpp else None,
            **exact.drafter_summary(),
            "lossless_mismatches": mismatches if greedy else None,
            "mismatch_causes": [tie.to_dict() for tie in ties.get(variant, [])],
            "mismatches_explained": sum(tie.explained for tie in ties.get(variant, [])) if greedy else None,
        }
        if confidence is not None:
            agreements = [agreement(r["ar"].tokens, r[f"dspark_{variant}_confidence"].tokens) for r in runs]
            entry["confidence_mode_speedup"] = confidence.tokens_per_s / ar if ar else None
            entry["confidence_mode_token_agreement"] = sum(agreements) / len(agreements) if greedy else None
        summary["drafters"][variant] = entry
    return summary


WARM_UP = "bench-decode-warm-up"


def warm_ups(sets: list[PromptSet]) -> list[GenerationRequest]:
    """A short request at each temperature the sets use, so greedy and sampling paths are both warm; in a traffic
    scope of their own, so the first prompt's measured runs do not draft from its warm-up's answer."""
    first = next(s for s in sets if s.requests).requests[0]
    temperatures = dict.fromkeys(s.temperature for s in sets if s.requests)
    return [first.model_copy(update={"max_tokens": 8, "temperature": t, "cache_scope": WARM_UP}) for t in temperatures]


def run_benchmark(
    model: Path,
    drafters_path: Path,
    sets: list[PromptSet],
    variants: list[str],
    dtype: str = "auto",
    confidence_mode: bool = False,
    gguf: Path | None = None,
    device: str = "cpu",
) -> dict:
    torch.manual_seed(0)
    contenders = Contenders(model, drafters_path, variants, dtype, confidence_mode, gguf, device)
    drafters = contenders.drafters
    runners = contenders.runners()
    for warm in warm_ups(sets):
        for run in runners.values():
            run(warm)
    report_sets: dict[str, dict] = {}
    probes: dict[str, dict[str, list[decode_probe.ProbeRows]]] = {d: {} for d in drafters}
    total = sum(len(s.requests) for s in sets)
    with JobProgress(log_every=5) as progress:
        task = progress.add_job("bench decode", total=total)
        for prompt_set in sets:
            tallies = {c: Tally() for c in runners}
            runs = []
            for request in prompt_set.requests:
                runs.append({c: run(request) for c, run in runners.items()})
                for c, r in runs[-1].items():
                    tallies[c].add(r)
                if request.greedy:
                    for drafter in drafters:
                        rows = contenders.probe(drafter, request, runs[-1]["ar"].tokens)
                        probes[drafter].setdefault(prompt_set.name, []).append(rows)
                progress.step(task, status=prompt_set.name)
            ties = contenders.ties(prompt_set, runs, variants) if prompt_set.temperature == 0 else {}
            report_sets[prompt_set.name] = set_summary(prompt_set, tallies, runs, variants, ties)
    drafted = [d for s in report_sets.values() for d in s["drafters"].values()]
    mismatches = [d["lossless_mismatches"] or 0 for d in drafted]
    return {
        "model": str(model),
        "drafters_path": str(drafters_path),
        "dtype": str(contenders.dspark.loaded.precision).removeprefix("torch."),
        "gguf": str(gguf) if gguf is not None else None,
        "cpu": cpu_chip(),
        "drafters": variants,
        "contenders": list(runners),
        "prompts": total,
        "max_tokens": max(r.max_tokens for s in sets for r in s.requests),
        "threads": torch.get_num_threads(),
        "lossless_mismatches": sum(mismatches),
        "mismatches_explained": sum(d["mismatches_explained"] or 0 for d in drafted),
        "sets": report_sets,
        "probe": {d: decode_probe.summary(rows, contenders.verified_at(d)) for d, rows in probes.items() if rows},
        "drafter_training": drafter_training_report(drafters_path),
        "round_costs_ms": contenders.round_costs(),
    }


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(report: dict) -> str:
    """Per set and drafter, within 80 columns: tokens/s of AR, HF greedy and DSpark, speedups, accepted and
    verified tokens per round, mismatches; then conditional acceptance by block position."""
    lines = [
        f"{'set':<16}{'drafter':<8}{'AR':>6}{'LC':>6}{'DSpark':>7}{'xAR':>6}{'xLC':>6}"
        f"{'accept':>7}{'verify':>7}{'mism':>5}",
        "tok/s; LC: llama.cpp on the same GGUF; accept: tokens a round (bonus",
        "included); verify: draft tokens verified; hybrid: dspark drafter plus blocks",
        "copied from the context; lookup: copied alone",
    ]
    for name, entry in report["sets"].items():
        tps = entry["tokens_per_s"]
        for drafter, d in entry["drafters"].items():
            lines.append(
                f"{name[:15]:<16}{drafter:<8}{tps['ar']:>6.0f}{_cell(tps.get('llama_cpp'), '.0f'):>6}"
                f"{d['tokens_per_s']:>7.0f}{_cell(d['speedup'], '.2f'):>6}"
                f"{_cell(d['speedup_vs_llama_cpp'], '.2f'):>6}"
                f"{_cell(d['mean_accepted'], '.2f'):>7}{_cell(d['mean_verified'], '.2f'):>7}"
                f"{_cell(d['lossless_mismatches'], 'd'):>5}"
            )
    lines.append("")
    lines.append("conditional acceptance by draft position (decoding runs)")
    for name, entry in report["sets"].items():
        for drafter, d in entry["drafters"].items():
            values = " ".join(f"{_cell(v, '.2f'):>4}" for v in d["conditional_acceptance"][:12])
            lines.append(f"{name[:15]:<16}{drafter:<8}{values}")
    lines.append(
        f"lossless mismatches (greedy): {report['lossless_mismatches']}, "
        f"{report['mismatches_explained']} of them ties within the target's rounding"
    )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--drafter-path", type=Path, help="the drafters' folder (default: the model's drafters)")
    parser.add_argument("--dtype", default="auto", help="the target's precision (auto: the packed GGUF blocks)")
    parser.add_argument("--device", default="cpu", help="where the target runs (cpu, cuda)")
    parser.add_argument(
        "--gguf", type=Path, help="the GGUF llama.cpp runs (default: the default model's own, where installed)"
    )
    parser.add_argument("--prompts", type=Path, help="a folder of *.jsonl prompt sets (e.g. ../shared/data/prompts)")
    parser.add_argument("--per-set", type=int, default=30, help="prompts per --prompts set")
    parser.add_argument("--per-category", type=int, default=8, help="held-out subtasks per category (0: none)")
    parser.add_argument("--temperatures", default="0,1", help="comma-separated, for the --prompts sets")
    parser.add_argument("--sampled-sets", help="comma-separated --prompts sets run at temperatures > 0 (default: all)")
    parser.add_argument(
        "--drafters",
        help=f"comma-separated variants of {', '.join(VARIANTS)} (default: all the drafters' folder allows)",
    )
    parser.add_argument(
        "--confidence-mode", action="store_true", help="also run heads and dspark committing drafts unverified"
    )
    parser.add_argument("--quick", action="store_true", help="2 prompts per set and category, 48 tokens")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--plots", type=Path, help="write the PNGs to this folder")


def choose_drafters(folder: Path, requested: str | None) -> tuple[list[str], list[str]]:
    """The variants to run and notes on those left out; a requested variant whose drafter the folder lacks is an
    error."""
    have = available_drafters(folder)
    possible = [v for v, (drafter, _) in VARIANTS.items() if drafter in have]
    wanted = [v.strip() for v in requested.split(",")] if requested else possible
    unknown = [v for v in wanted if v not in possible]
    if unknown or not wanted:
        raise SystemExit(f"bench decode: {folder} allows {possible or 'no variant'}; asked for {wanted}")
    return wanted, [f"{folder.name} has no {d} drafter: not benchmarked" for d in DRAFTERS if d not in have]


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    per_set, per_category, max_tokens = (2, 2, 48) if args.quick else (args.per_set, args.per_category, args.max_tokens)
    folder = args.drafter_path or drafters_for(args.model)
    drafters, notes = choose_drafters(folder, args.drafters)
    sets = held_out_sets(per_category, max_tokens) if per_category else []
    if args.prompts:
        temperatures = [float(t) for t in args.temperatures.split(",")]
        sampled = set(args.sampled_sets.split(",")) if args.sampled_sets else None
        sets += shared_sets(args.prompts, per_set, max_tokens, temperatures, sampled)
    gguf = gguf_for(args.model, args.gguf)
    if gguf is None:
        notes.append("no llama.cpp peer: no llama-cpp-python (make bench) or no --gguf")
    for note in notes:
        print(f"note: {note}")
    report = {
        **run_benchmark(args.model, folder, sets, drafters, args.dtype, args.confidence_mode, gguf, args.device),
        "notes": notes,
    }
    print(format_table(report))
    write_json(args.json, report)
    write_plots(args.plots, report, decode_plots.draw_all)
    return 0

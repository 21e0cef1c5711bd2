"""``dspark-router bench batching``: throughput against per-request speed as concurrency grows, for the batched
pools and the engines they stand beside, side by side in one run (the paper's Figures 7 and 8).

Contenders, all on one model (the local ones share its weights; each has a batching loop of its own):

* ``batched``: the standard pool's autoregressive backend, continuous batching;
* ``sequential``: the same backend one request at a time (``max_batch: 1``);
* ``dspark_scheduled``: the DSpark pool as a pool loads it (its default drafter and copied blocks, see
  :data:`backends.dspark.backend.DEFAULT_LOOKUP`), verified across the batch with Algorithm 1 over the profiled
  cost curve;
* ``dspark_fixed``: the same decoding verifying its whole block whatever the load;
* ``transformers_serve``: ``transformers serve --continuous-batching`` on the same model, over loopback.

At each concurrency C, C clients run a closed loop (a client sends its next request when the last one is
answered) for ``--window`` seconds over a mix of held-out subtasks and ``--prompts`` (real benchmark prompts,
evaluation only), greedy. Total tokens/s counts every completion token over the wall time until the last
answer; per-request tokens/s is a request's completion tokens over its latency, queue wait included.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from backends.default_model import DEFAULT_MODEL
from backends.progress import JobProgress
from backends.types import GenerationRequest
from benchmarks.decode_sets import held_out_sets, shared_sets
from benchmarks.local_serve import transformers_serve
from benchmarks.output import write_json

CONCURRENCY = (1, 4, 16, 64)
CONTENDERS = ("batched", "sequential", "dspark_scheduled", "dspark_fixed", "transformers_serve")
Complete = Callable[[GenerationRequest], int]
"""Runs one request, returns its completion tokens."""


def workload(prompts: Path | None, per_set: int, max_tokens: int) -> list[GenerationRequest]:
    """Held-out subtasks of every category and the shared prompt sets, interleaved, all greedy."""
    sets = [s for s in held_out_sets(per_set, max_tokens) if s.temperature == 0]
    if prompts is not None:
        sets += shared_sets(prompts, per_set, max_tokens, [0.0])
    mixed = itertools.zip_longest(*(s.requests for s in sets))
    return [request for row in mixed for request in row if request is not None]


def trace_workload(per_job: int, seed: int) -> list[GenerationRequest]:
    """An agent's templated traffic: ``per_job`` requests of every job of ``bench trace`` (each with its own
    ``max_tokens``), the jobs interleaved. A seed per concurrency level draws each level's contents anew, so a
    DSpark pool does not draft a level's answers from the same requests' answers at the level before (jobs whose
    contents come from short lists repeat some, as an agent's traffic and bench trace do)."""
    from benchmarks.trace_jobs import JOBS, requests

    rows = zip(*(requests(job, per_job, seed) for job in JOBS))
    return [GenerationRequest(**body) for row in rows for body in row]


def closed_loop(complete: Complete, requests: list[GenerationRequest], clients: int, window_s: float) -> dict:
    """``clients`` threads sending requests back to back until the window closes; answers still in flight then
    are waited for and counted. Each pass over ``requests`` is a cache scope of its own, never used by another
    loop, so a DSpark pool never drafts a request's answer from its own answer a pass before (a window outlasts a
    pass at 16 clients) nor from a loop before (the held-out mix sends the same requests at every level): within
    a pass, what one request's answer teaches the next is measured, as an agent's traffic would show it."""
    loop = uuid.uuid4().hex[:8]
    order = (r.model_copy(update={"cache_scope": f"{loop}/pass-{n}"}) for n in itertools.count() for r in requests)
    lock = threading.Lock()
    runs: list[tuple[int, float]] = []
    errors: list[str] = []
    started = time.perf_counter()
    deadline = started + window_s

    def client() -> None:
        while time.perf_counter() < deadline:
            with lock:
                request = next(order)
            sent = time.perf_counter()
            try:
                tokens = complete(request)
            except Exception as exc:  # recorded and reported: a contender that fails must not look fast
                errors.append(f"{type(exc).__name__}: {exc}")
                return
            with lock:
                runs.append((tokens, time.perf_counter() - sent))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    tokens = sum(t for t, _ in runs)
    return {
        "requests": len(runs),
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": tokens / wall if wall else 0.0,
        "per_request_tokens_per_s": statistics.mean(t / s for t, s in runs) if runs else 0.0,
        "p50_latency_s": statistics.median(s for _, s in runs) if runs else 0.0,
        "errors": errors[:3],
    }


def fitting(loaded, requests: list[GenerationRequest]) -> tuple[list[GenerationRequest], int]:
    """The requests whose prompt plus max_tokens fit the model's context (a refused request would end its
    client's loop and leave the contender running below the concurrency it is measured at), and how many not."""
    from backends.errors import InvalidRequestError
    from backends.loading import prompt_ids

    kept = []
    for request in requests:
        try:
            prompt_ids(loaded, request)
        except InvalidRequestError:
            continue
        kept.append(request)
    return kept, len(requests) - len(kept)


class LocalContenders:
    """The in-process contenders on one loaded model; each keeps the verification budgets its engine grants."""

    def __init__(self, model: Path, max_batch: int, device: str = "cpu") -> None:
        from backends.autoregressive import AutoregressiveBackend
        from backends.dspark.backend import DSparkBackend
        from backends.engine import BatchLimits
        from backends.scheduling import VerifySchedule

        limits = BatchLimits(max_batch=max_batch, max_queue=4 * max_batch)
        scheduled = DSparkBackend.from_pretrained(model, device=device, limits=limits)
        loaded = scheduled.loaded
        fixed = DSparkBackend(
            scheduled.model,
            scheduled.policy,
            drafter=scheduled.drafter,
            schedule=VerifySchedule(sps=None, verification="exact", lookup=scheduled.schedule.lookup),
            default=scheduled.default,
            loaded=loaded,
            limits=limits,
        )
        self.drafter = scheduled.default
        self.lookup = scheduled.schedule.lookup
        self.backends = {
            "batched": AutoregressiveBackend(loaded, limits),
            "sequential": AutoregressiveBackend(loaded, BatchLimits(max_batch=1, max_queue=4 * max_batch)),
            "dspark_scheduled": scheduled,
            "dspark_fixed": fixed,
        }
        self.budgets: dict[str, list[int]] = {name: [] for name in self.backends}
        for name, backend in self.backends.items():
            backend.engine.observers.append(lambda record, name=name: self.budgets[name].extend(record.budgets))

    def complete(self, name: str) -> Complete:
        backend = self.backends[name]
        return lambda request: backend.complete(request).usage.completion_tokens

    def rest(self, name: str) -> None:
        """End the contender's batching thread before another is measured, so each starts on an idle machine."""
        if name in self.backends:
            self.backends[name].engine.stop()


@contextmanager
def transformers_serve_contender(model: Path, threads: int) -> Iterator[Complete]:
    """``transformers serve --continuous-batching`` on the same model, asked through the openai SDK."""
    import openai

    with transformers_serve(model, threads) as (_, api_base):
        client = openai.OpenAI(base_url=api_base, api_key="none", max_retries=0, timeout=300)

        def complete(request: GenerationRequest) -> int:
            messages = [{"role": m.role, "content": m.content} for m in request.messages]
            answer = client.chat.completions.create(
                model=str(model), messages=messages, max_tokens=request.max_tokens, temperature=0
            )
            return answer.usage.completion_tokens

        yield complete


def run_benchmark(
    model: Path,
    workload_at: Callable[[int], list[GenerationRequest]],
    levels: list[int],
    contenders: list[str],
    window_s: float,
    threads: int,
    device: str = "cpu",
    mix: str = "held-out",
) -> dict:
    """Every contender at every level, in turn; ``workload_at(level)`` is the requests the clients cycle through
    at that level."""
    local = LocalContenders(model, max(levels), device)
    loaded = local.backends["batched"].loaded
    workloads = {level: fitting(loaded, workload_at(level)) for level in levels}
    requests = workloads[levels[0]][0]
    report: dict = {
        "model": str(model),
        "drafter": local.drafter,
        "lookup": local.lookup,
        "mix": mix,
        "window_s": window_s,
        "max_tokens": max(r.max_tokens for r in requests),
        "threads": threads,
        "workload": len(requests),
        "dropped_too_long": sum(dropped for _, dropped in workloads.values()),
        "concurrency": {},
    }
    serve = transformers_serve_contender(model, threads) if "transformers_serve" in contenders else None
    with JobProgress(log_every=1) as progress, serve or nullcontext() as served:
        task = progress.add_job("bench batching", total=len(levels) * len(contenders))
        for name in contenders:  # one unmeasured request each: loads, profiles and warms every path
            (served if name == "transformers_serve" else local.complete(name))(requests[0])
            local.rest(name)
        for level in levels:
            row: dict = {}
            requests = workloads[level][0]
            for name in contenders:
                complete = served if name == "transformers_serve" else local.complete(name)
                before = len(local.budgets.get(name, []))
                loop = closed_loop(complete, requests, level, window_s)
                local.rest(name)
                row[f"{name}_tokens_per_s"] = round(loop["tokens_per_s"], 2)
                row[f"{name}_per_request_tokens_per_s"] = round(loop["per_request_tokens_per_s"], 2)
                row[f"{name}_p50_latency_s"] = round(loop["p50_latency_s"], 3)
                row[f"{name}_requests"] = loop["requests"]
                if loop["errors"]:
                    row[f"{name}_errors"] = loop["errors"]
                if name.startswith("dspark"):
                    budgets = local.budgets[name][before:]
                    row[f"{name}_mean_verify_budget"] = round(statistics.mean(budgets), 3) if budgets else None
                progress.step(task, status=f"C={level} {name}: {loop['tokens_per_s']:.0f} tok/s")
            report["concurrency"][str(level)] = row
    return report


def print_table(report: dict, contenders: list[str]) -> None:
    short = {"batched": "batch", "sequential": "seq", "dspark_scheduled": "ds-sch", "dspark_fixed": "ds-fix"}
    short["transformers_serve"] = "tf-srv"
    print("total tokens/s (per-request tokens/s)")
    print("C    " + "".join(f"{short[n]:>14}" for n in contenders))
    for level, row in report["concurrency"].items():
        cells = [f"{row[f'{n}_tokens_per_s']:7.0f} ({row[f'{n}_per_request_tokens_per_s']:4.0f})" for n in contenders]
        print(f"{level:<5}" + "".join(f"{c:>14}" for c in cells))


def plot(report: dict, contenders: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = list(report["concurrency"])
    rows = [report["concurrency"][c] for c in levels]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in contenders:
        x = [r[f"{name}_per_request_tokens_per_s"] for r in rows]
        y = [r[f"{name}_tokens_per_s"] for r in rows]
        left.plot(x, y, marker="o", label=name)
        for xi, yi, level in zip(x, y, levels):
            left.annotate(level, (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7)
    left.set(xlabel="per-request tokens/s", ylabel="total tokens/s", title="throughput vs speed (labels: C)")
    left.legend(fontsize=8)
    for name in [n for n in contenders if n.startswith("dspark")]:
        budgets = [r[f"{name}_mean_verify_budget"] for r in rows]
        if any(b is not None for b in budgets):  # span heads keep their own thresholds: no budget to plot
            right.plot([int(c) for c in levels], budgets, marker="o", label=name)
    right.set(xscale="log", xlabel="concurrent requests", ylabel="draft tokens verified per request per step")
    right.set_title("verification budget vs load")
    if right.lines:
        right.legend(fontsize=8)
    else:
        right.text(0.5, 0.5, "no published drafter: nothing scheduled", ha="center", transform=right.transAxes)
    decoding = f"drafter {report['drafter']}, lookup {report.get('lookup', 'off')}"
    fig.suptitle(f"bench batching: {Path(report['model']).name}, {decoding}, greedy")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--prompts", type=Path, help="a folder of *.jsonl prompt sets (e.g. ../shared/data/prompts)")
    parser.add_argument(
        "--mix",
        choices=("held-out", "trace"),
        default="held-out",
        help="held-out subtasks and --prompts, or an agent's templated traffic (bench trace's jobs interleaved)",
    )
    parser.add_argument(
        "--per-set", type=int, default=8, help="requests per held-out category and prompt set, or per trace job"
    )
    parser.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)), help="comma-separated levels")
    parser.add_argument(
        "--contenders", default=",".join(CONTENDERS), help="comma-separated, of: " + ",".join(CONTENDERS)
    )
    parser.add_argument("--window", type=float, default=20.0, help="seconds of closed loop per contender and level")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--device", default="cpu", help="where the model runs (cpu, cuda)")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--plot", type=Path, help="write the figure (PNG) here")


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = sorted(set(contenders) - set(CONTENDERS))
    if unknown or not contenders:
        raise SystemExit(f"bench batching: unknown contenders {unknown}; choose from {', '.join(CONTENDERS)}")
    levels = [int(c) for c in args.concurrency.split(",")]
    held_out = None if args.mix == "trace" else workload(args.prompts, args.per_set, args.max_tokens)

    def workload_at(level: int) -> list[GenerationRequest]:
        return trace_workload(args.per_set, seed=level) if held_out is None else held_out

    report = run_benchmark(
        args.model, workload_at, levels, contenders, args.window, torch.get_num_threads(), args.device, args.mix
    )
    print_table(report, contenders)
    write_json(args.json, report)
    if args.plot:
        plot(report, contenders, args.plot)
    return 0

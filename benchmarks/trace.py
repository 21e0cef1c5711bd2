"""``dspark-router bench trace``: an agent's trace replayed job by job through the real gateway, the DSpark pool
against the standard pool, by position within a job.

A job is one template sent many times with different contents (:mod:`benchmarks.trace_jobs`); the DSpark pool
drafts from its own earlier answers (:mod:`backends.dspark.traffic`), so what it gains should grow with a request's
position in its job, while the first requests of a job, which the cache cannot help, should never be slower than
the standard pool. Each request goes to both pools over loopback HTTP (the gateway on uvicorn in a thread of this
process, one keep-alive connection), DSpark and standard interleaved, the order alternating; both are greedy, so
their answers must be the same token for token.

Reported per job and over jobs, for the first :data:`WARM` requests of a job and from the next on: tokens a forward
and tokens per second of both pools, and their ratio. Beside them, transformers' prompt lookup (10 tokens a round,
on the float32 reference) on the late requests' prompts, tokens a forward only (its time is transformers'). And the
cache itself: the answers and tokens it holds, its memory, and what inserting a token and drafting once cost,
timed on the trace's own answers.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.output import write_json
from benchmarks.trace_jobs import JOBS, requests

if TYPE_CHECKING:
    from backends.loading import LoadedModel

WARM = 8
"""Requests of a job before the targets count: the cache is learning the template."""
TARGETS = {"late_tokens_per_forward": 3.5, "late_speedup": 2.0, "job_tokens_per_forward": 2.5, "job_speedup": 1.5}
POOLS = ("dspark", "standard")


def _post(connection: http.client.HTTPConnection, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
    started = time.perf_counter()
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    answer = json.loads(response.read())
    if response.status != 200:
        raise RuntimeError(f"the gateway answered {response.status}: {answer}")
    return answer, time.perf_counter() - started


def _run(answer: dict[str, Any], seconds: float) -> dict[str, Any]:
    usage = answer["usage"]
    message = answer["choices"][0]["message"]
    calls = [call["function"] for call in message.get("tool_calls") or []]  # each call's id is drawn at random
    text = message.get("content") or json.dumps(calls)
    forwards = (usage.get("dspark") or {}).get("forward_passes") or usage["completion_tokens"]
    served = answer.get("dspark_router", {}).get("decision", {}).get("pool")
    tokens = usage["completion_tokens"]
    return {"tokens": tokens, "forwards": forwards, "seconds": seconds, "text": text, "pool": served}


def replay(
    config: str | None, jobs: list[str], count: int, progress: Any, models: tuple[str, ...] = POOLS
) -> dict[str, dict[str, list]]:
    """Every job's requests through the gateway of a fresh router, to each of ``models`` (``dspark-router/NAME``) in
    turn, alternating which goes first: {job: {model: [run, ...]}}."""
    from benchmarks.gateway import serving
    from router.gateway.app import create_app
    from router.gateway.settings import GatewayConfig
    from router.sdk import Router

    runs: dict[str, dict[str, list]] = {job: {model: [] for model in models} for job in jobs}
    task = progress.add_job(f"bench trace ({', '.join(models)})", total=len(jobs) * count)
    with Router.from_config(config) as router:
        router.warmup()
        app = create_app(router, GatewayConfig(api_keys_env=None), warmup=False)
        with serving(app) as port:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
            for job in (j for j in JOBS if j.name in jobs):
                for i, body in enumerate(requests(job, count)):
                    for model in models if i % 2 == 0 else models[::-1]:
                        answer, seconds = _post(connection, {**body, "model": f"dspark-router/{model}"})
                        runs[job.name][model].append(_run(answer, seconds))
                    progress.step(task, status=f"{job.name} {i + 1}")
    return runs


@contextmanager
def redis_workers(count: int, folder: Path) -> Iterator[tuple[str, Callable[[], list[str]]]]:
    """The embedded config with its DSpark pool served by ``count`` ``dspark-router worker`` processes over Redis
    (``REDIS_URL``, else a private server), every worker up: yields the config's path and a function giving, in
    order, which worker wrote each answer (the pool's traffic stream, which every worker publishes its answers on
    and inserts the others' from). Idle workers wait on the job stream in turn, so a replay's consecutive requests
    land on different workers; the function shows how many did."""
    import redis
    import yaml

    from benchmarks.local_redis import local_redis
    from router.config import DEFAULT_CONFIG
    from router.redis_jobs import PoolKeys
    from router.sdk import Router

    data = yaml.safe_load(DEFAULT_CONFIG.read_text())
    prefix = f"trace-{uuid.uuid4().hex[:8]}"
    with local_redis() as url, ExitStack() as stack:
        data["pools"]["dspark"].update(transport="redis", redis_url=url, redis={"prefix": prefix})
        config = folder / "router.yaml"
        config.write_text(yaml.safe_dump(data))
        for i in range(count):
            log = stack.enter_context((folder / f"worker-{i}.log").open("w"))
            command = [sys.executable, "-m", "router", "worker", "--config", str(config), "--pool", "dspark"]
            worker = subprocess.Popen(command, stdout=log, stderr=log)
            stack.callback(lambda w=worker: (w.terminate(), w.wait(30)))
        with Router.from_config(config) as router:
            deadline = time.monotonic() + 300
            while len(router.pools["dspark"].live_workers()) < count:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the DSpark pool's {count} workers did not come up (logs in {folder})")
                time.sleep(0.2)
        client = redis.Redis.from_url(url)
        stack.callback(client.close)
        stream = PoolKeys(prefix, "dspark").traffic
        yield str(config), lambda: [fields[b"origin"].decode() for _, fields in client.xrange(stream, "-", "+")]


def routed(paired: dict[str, dict[str, list]], auto: dict[str, dict[str, list]]) -> dict[str, Any]:
    """The trace through ``dspark-router/auto`` (a replay of its own, from fresh caches) against all-DSpark and
    all-standard (the paired replay), and the oracle that sends each request to whichever pool answered it faster
    there: seconds for the whole trace, auto's share of the time the oracle saves over the faster of the two, and
    how many of its requests auto sent to DSpark."""
    seconds = lambda runs: sum(r["seconds"] for r in runs)  # noqa: E731
    all_dspark = sum(seconds(job["dspark"]) for job in paired.values())
    all_standard = sum(seconds(job["standard"]) for job in paired.values())
    pairs = [(d, s) for job in paired.values() for d, s in zip(job["dspark"], job["standard"])]
    oracle = sum(min(d["seconds"], s["seconds"]) for d, s in pairs)
    auto_s = sum(seconds(job["auto"]) for job in auto.values())
    best = min(all_dspark, all_standard)
    to_dspark = {name: sum(r["pool"] == "dspark" for r in job["auto"]) for name, job in auto.items()}
    return {
        "auto_s": auto_s,
        "all_dspark_s": all_dspark,
        "all_standard_s": all_standard,
        "oracle_s": oracle,
        "oracle_share": (all_standard - auto_s) / (all_standard - oracle) if all_standard > oracle else None,
        "no_later_than_best": auto_s <= best,
        "auto_to_dspark": to_dspark,
        "requests": sum(len(job["auto"]) for job in auto.values()),
    }


def reference() -> LoadedModel:
    """The default model in float32 on transformers: prompt lookup's model, and the tokenizer the peers and the
    cache's costs read, loaded once for all of them."""
    from backends.default_model import DEFAULT_MODEL
    from backends.loading import load_model

    return load_model(DEFAULT_MODEL, device="cpu", dtype="float32")


def prompt_lookup(loaded: LoadedModel, jobs: list[str], count: int, per_job: int) -> dict[str, float]:
    """transformers' prompt lookup on the float32 reference: tokens a forward on each job's first ``per_job``
    requests after :data:`WARM`, greedy (every forward of ``generate`` counted)."""
    from backends.loading import prompt_ids
    from backends.types import GenerationRequest
    from benchmarks.decode import hf_generate

    result = {}
    for job in (j for j in JOBS if j.name in jobs):
        late = requests(job, count)[WARM : WARM + per_job]
        committed = forwards = 0
        for body in late:
            request = GenerationRequest(**body)
            run = hf_generate(loaded, prompt_ids(loaded, request), request, prompt_lookup_num_tokens=10)
            committed, forwards = committed + run.committed, forwards + run.forwards
        result[job.name] = committed / forwards if forwards else 0.0
    return result


def llama_lookup(loaded: LoadedModel, jobs: list[str], count: int, progress: Any) -> dict[str, Any]:
    """llama.cpp's lookup decoding (:mod:`benchmarks.llama_lookup`) on every request of each job, drafting from one
    n-gram cache per job, and plain llama.cpp (the same binary, no drafts) on the late ones: per job, tokens a
    forward early and late, and tokens per second of both late; by position, tokens a forward. ``loaded``: the
    model whose chat template and tokenizer write the prompts."""
    from backends.convert import packaged_gguf
    from backends.loading import prompt_ids
    from backends.packed.pool import default_threads
    from backends.types import GenerationRequest
    from benchmarks.llama_lookup import run_lookup

    gguf, threads = packaged_gguf(), default_threads()
    runs: dict[str, list] = {}
    plain: dict[str, list] = {}
    prompts_read_alike = True
    task = progress.add_job("bench trace (llama-lookup)", total=len(jobs) * count)
    with tempfile.TemporaryDirectory() as folder:
        for job in (j for j in JOBS if j.name in jobs):
            cache = Path(folder) / f"{job.name}.bin"
            runs[job.name], plain[job.name] = [], []
            for i, body in enumerate(requests(job, count)):
                request = GenerationRequest(**body)
                ids = prompt_ids(loaded, request)
                prompt = loaded.tokenizer.decode(ids, skip_special_tokens=False)
                run = run_lookup(gguf, prompt, request, cache, threads)
                prompts_read_alike &= run.prompt_tokens == len(ids)
                runs[job.name].append(run)
                if i >= WARM:  # a cache file of its own, thrown away: plain decoding must not feed the job's
                    throwaway = Path(folder) / "plain.bin"
                    plain[job.name].append(run_lookup(gguf, prompt, request, throwaway, threads, draft_tokens=0))
                    throwaway.unlink(missing_ok=True)
                progress.step(task, status=f"{job.name} {i + 1}")
    per_forward = lambda rs: sum(r.decoded for r in rs) / sum(r.forwards for r in rs)  # noqa: E731
    rate = lambda rs: sum(r.decoded for r in rs) / sum(r.seconds for r in rs)  # noqa: E731
    summary = {
        name: {
            "early_tokens_per_forward": per_forward(job_runs[:WARM]),
            "late_tokens_per_forward": per_forward(job_runs[WARM:]),
            "late_tokens_per_s": rate(job_runs[WARM:]),
            "plain_tokens_per_s": rate(plain[name]),
            "late_speedup": rate(job_runs[WARM:]) / rate(plain[name]),
        }
        for name, job_runs in runs.items()
        if job_runs[WARM:]
    }
    return {
        "jobs": summary,
        "late_tokens_per_forward": statistics.mean(j["late_tokens_per_forward"] for j in summary.values()),
        "late_speedup": statistics.mean(j["late_speedup"] for j in summary.values()),
        "by_position": [
            statistics.mean(job_runs[i].decoded / job_runs[i].forwards for job_runs in runs.values())
            for i in range(min(map(len, runs.values())))
        ],
        "prompts_read_alike": prompts_read_alike,
    }


def cache_costs(runs: dict[str, dict[str, list]], tokenizer: Any) -> dict[str, float]:
    """The trace's DSpark answers (tokenized by ``tokenizer``) inserted into a fresh cache, and a draft asked after
    every token of each: the microseconds a token's insertion and a draft cost, and the memory the cache holds."""
    from backends.dspark.traffic import TrafficCache
    from backends.traffic_settings import TrafficSettings

    answers = [tokenizer.encode(run["text"]) for job in runs.values() for run in job["dspark"]]
    cache = TrafficCache(TrafficSettings())
    started = time.perf_counter()
    for answer in answers:
        cache.insert(answer)
    inserted = time.perf_counter() - started
    asked, started = 0, time.perf_counter()
    for answer in answers:
        for end in range(3, len(answer)):
            cache.speculate(answer[:end], 15)
            asked += 1
    drafting = time.perf_counter() - started
    tokens = sum(map(len, answers))
    return {
        "answers": cache.answers,
        "tokens": cache.cached_tokens,
        "memory_mb": cache.memory_bytes / 1e6,
        "insert_us_per_token": 1e6 * inserted / max(tokens, 1),
        "speculate_us": 1e6 * drafting / max(asked, 1),
    }


def summarise(runs: dict[str, dict[str, list]]) -> dict[str, Any]:
    """Per job and over jobs: tokens a forward and tokens per second of each pool, early and late in a job."""

    def part(job_runs: dict[str, list], positions: slice) -> dict[str, float]:
        d, s = job_runs["dspark"][positions], job_runs["standard"][positions]
        if not d:
            return {}
        rate = lambda rs: sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs)  # noqa: E731
        return {
            "tokens_per_forward": sum(r["tokens"] for r in d) / sum(r["forwards"] for r in d),
            "dspark_tokens_per_s": rate(d),
            "standard_tokens_per_s": rate(s),
            "speedup": rate(d) / rate(s),
        }

    jobs = {
        name: {"early": part(job, slice(0, WARM)), "late": part(job, slice(WARM, None))} for name, job in runs.items()
    }
    mismatched = sum(d["text"] != s["text"] for job in runs.values() for d, s in zip(job["dspark"], job["standard"]))
    late = [j["late"] for j in jobs.values() if j["late"]]
    by_position = [
        {
            "tokens_per_forward": statistics.mean(
                job["dspark"][i]["tokens"] / job["dspark"][i]["forwards"] for job in runs.values()
            ),
            "speedup": statistics.mean(
                job["standard"][i]["seconds"]
                / job["standard"][i]["tokens"]
                * job["dspark"][i]["tokens"]
                / job["dspark"][i]["seconds"]
                for job in runs.values()
            ),
        }
        for i in range(min(len(job["dspark"]) for job in runs.values()))
    ]
    return {
        "jobs": jobs,
        "by_position": by_position,
        "late_tokens_per_forward": statistics.mean(j["tokens_per_forward"] for j in late) if late else None,
        "late_speedup": statistics.mean(j["speedup"] for j in late) if late else None,
        "early_never_slower": all(j["early"]["speedup"] >= 1.0 for j in jobs.values()),
        "greedy_mismatches": mismatched,
    }


def show(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=80)
    table = Table(title=f"Agent trace through the gateway: from request {WARM + 1} of a job on (first {WARM})")
    for column in ("job", "tok/fwd", "DSpark tok/s", "standard", "speedup", "first 8"):
        table.add_column(column, justify="left" if column == "job" else "right")
    for name, job in report["summary"]["jobs"].items():
        late, early = job["late"], job["early"]
        table.add_row(
            name,
            f"{late['tokens_per_forward']:.2f}",
            f"{late['dspark_tokens_per_s']:.0f}",
            f"{late['standard_tokens_per_s']:.0f}",
            f"{late['speedup']:.2f}x",
            f"{early['speedup']:.2f}x",
        )
    console.print(table)
    s = report["summary"]
    console.print(
        f"over jobs: {s['late_tokens_per_forward']:.2f} tokens a forward, {s['late_speedup']:.2f}x the standard "
        f"pool (targets {TARGETS['late_tokens_per_forward']} and {TARGETS['late_speedup']}x); greedy mismatches "
        f"{s['greedy_mismatches']}"
    )
    show_peers(report, console)
    if "redis_workers" in report:
        console.print(redis_line(report["redis_workers"]))
    if "auto" in report:
        a = report["auto"]
        share = "-" if a["oracle_share"] is None else f"{a['oracle_share']:.0%}"
        console.print(
            f"auto: {a['auto_s']:.1f} s for the trace, {sum(a['auto_to_dspark'].values())} of {a['requests']} "
            f"requests to DSpark (all-DSpark {a['all_dspark_s']:.1f} s, all-standard {a['all_standard_s']:.1f} s, "
            f"oracle {a['oracle_s']:.1f} s: {share} of the oracle's saving)"
        )
    c = report["cache"]
    console.print(
        f"cache: {c['answers']} answers, {c['tokens']:,} tokens, {c['memory_mb']:.1f} MB; insert "
        f"{c['insert_us_per_token']:.1f} us a token, a draft {c['speculate_us']:.0f} us"
    )


def redis_line(workers: dict[str, int]) -> str:
    return (
        f"the DSpark pool on {workers['workers']} Redis workers sharing one traffic cache: {workers['switched']} of "
        f"{workers['answers'] - 1} consecutive answers came from different workers"
    )


def show_peers(report: dict[str, Any], console: Any) -> None:
    """The late requests beside the peers: tokens a forward, and each speculative decoder's speed over plain
    decoding in its own engine (ours over the standard pool, llama.cpp's lookup over llama.cpp)."""
    from rich.table import Table

    llama = report.get("llama_lookup", {}).get("jobs", {})
    lookup = report.get("prompt_lookup_tokens_per_forward", {})
    if not llama and not lookup:
        return
    table = Table(title="Peers, late requests: tokens a forward (speed over own plain decoding)")
    for column in ("job", "DSpark", "llama-lookup", "prompt lookup"):
        table.add_column(column, justify="left" if column == "job" else "right")
    for name, job in report["summary"]["jobs"].items():
        ours, peer = job["late"], llama.get(name)
        table.add_row(
            name,
            f"{ours['tokens_per_forward']:.2f} ({ours['speedup']:.2f}x)",
            f"{peer['late_tokens_per_forward']:.2f} ({peer['late_speedup']:.2f}x)" if peer else "-",
            f"{lookup[name]:.2f}" if name in lookup else "-",
        )
    console.print(table)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    positions = report["summary"]["by_position"]
    x = list(range(1, len(positions) + 1))
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    left.plot(x, [p["tokens_per_forward"] for p in positions], marker="o", label="DSpark")
    if "llama_lookup" in report:
        left.plot(x, report["llama_lookup"]["by_position"][: len(x)], marker="s", label="llama-lookup")
    left.axhline(1.0, color="grey", linestyle="--", label="standard")
    left.set_ylabel("tokens a forward (mean over jobs)")
    right.plot(x, [p["speedup"] for p in positions], marker="o", color="tab:green")
    right.axhline(1.0, color="grey", linestyle="--")
    right.set_ylabel("DSpark tok/s over standard")
    for ax in (left, right):
        ax.axvline(WARM + 0.5, color="lightgrey")
        ax.set_xlabel("request's position in its job")
    left.legend(fontsize=8)
    fig.suptitle("Agent trace by position within a job", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="router YAML (default: the embedded two-pool config on the default model)")
    parser.add_argument("--jobs", default=",".join(j.name for j in JOBS), help="comma-separated jobs to replay")
    parser.add_argument("--requests", type=int, default=20, help="requests of each job")
    parser.add_argument(
        "--peer-requests", type=int, default=3, help="late requests a job gives prompt lookup (0: none)"
    )
    parser.add_argument(
        "--llama-lookup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="replay the trace through llama.cpp's llama-lookup as well, where `make llama-lookup` built it",
    )
    parser.add_argument(
        "--auto",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="replay the trace once more through dspark-router/auto, from fresh caches",
    )
    parser.add_argument(
        "--redis-workers",
        type=int,
        default=0,
        help="serve the DSpark pool by this many Redis workers sharing one traffic cache (0: in process)",
    )
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--plot", type=Path, help="write the PNG here")


def run(args: argparse.Namespace) -> int:
    from backends.precision import cpu_chip
    from backends.progress import JobProgress
    from benchmarks.llama_lookup import LLAMA_LOOKUP

    jobs = [name for name in args.jobs.split(",") if name]
    unknown = set(jobs) - {j.name for j in JOBS}
    if unknown:
        raise SystemExit(f"unknown jobs: {', '.join(sorted(unknown))}")
    origins: list[str] = []
    with JobProgress(log_every=5) as progress, tempfile.TemporaryDirectory() as folder:
        if args.redis_workers:
            with redis_workers(args.redis_workers, Path(folder)) as (config, answered_by):
                runs = replay(config, jobs, args.requests, progress)
                origins = answered_by()
        else:
            runs = replay(args.config, jobs, args.requests, progress)
        auto = replay(args.config, jobs, args.requests, progress, ("auto",)) if args.auto else None
    loaded = reference()
    report: dict[str, Any] = {
        "cpu": cpu_chip(),
        "requests_per_job": args.requests,
        "warm": WARM,
        "targets": TARGETS,
        "summary": summarise(runs),
        "cache": cache_costs(runs, loaded.tokenizer),
        "runs": {job: {pool: [{k: v for k, v in r.items() if k != "text"} for r in rs] for pool, rs in job_runs.items()}
                 for job, job_runs in runs.items()},
    }  # fmt: skip
    if origins:
        switched = sum(a != b for a, b in itertools.pairwise(origins))
        report["redis_workers"] = {"workers": args.redis_workers, "answers": len(origins), "switched": switched}
    if auto is not None:
        report["auto"] = routed(runs, auto)
    if args.llama_lookup and LLAMA_LOOKUP.is_file():
        with JobProgress(log_every=5) as progress:
            report["llama_lookup"] = llama_lookup(loaded, jobs, args.requests, progress)
    elif args.llama_lookup:
        print(f"no llama-lookup peer: {LLAMA_LOOKUP} is not built (make llama-lookup)")
    if args.peer_requests:
        report["prompt_lookup_tokens_per_forward"] = prompt_lookup(loaded, jobs, args.requests, args.peer_requests)
    show(report)
    write_json(args.json, report)
    if args.plot:
        plot(report, args.plot)
    return 0

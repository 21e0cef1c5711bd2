"""``dspark-router bench pools``: what serving a pool through Redis workers costs, against in-process pools on the
same machine, side by side in one run.

Contenders (autoregressive decoding of the same model, one torch thread per worker):

* ``inprocess_1`` / ``inprocess_2``: an in-process pool with 1 or 2 worker threads;
* ``redis_1`` / ``redis_2``: a ``transport: redis`` pool served by 1 or 2 ``dspark-router worker`` processes.

Two measurements, contenders interleaved request by request:

* sequential streams (one request at a time): latency, time to first token and the gap between streamed chunks,
  whose differences to ``inprocess_1`` on the same request (median over requests) are the Redis hop per request
  and per streamed token;
* a closed loop of ``--concurrency`` clients: requests and tokens per second, p50/p95 latency.

Redis is ``REDIS_URL`` when set, else a private ``redis-server`` on a free port, stopped afterwards.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import torch
import yaml

from backends.corpus.subtasks import KINDS, OPEN_ENDED_KINDS, generate_subtasks
from backends.default_model import DEFAULT_MODEL
from backends.progress import JobProgress
from benchmarks.local_redis import local_redis
from benchmarks.output import write_json

HELD_OUT_SEED = 9_002
CONTENDERS = {"inprocess_1": 1, "inprocess_2": 2, "redis_1": 1, "redis_2": 2}


def requests(count: int, max_tokens: int) -> list[dict]:
    """Held-out deterministic subtasks, greedy, at most ``max_tokens``: the traffic a DSpark pool gets."""
    kinds = [k for k in KINDS if k not in OPEN_ENDED_KINDS]
    chosen = generate_subtasks(count, seed=HELD_OUT_SEED, kinds=kinds)
    return [
        {**s.to_request_dict(), "temperature": 0, "max_tokens": min(s.max_tokens, max_tokens), "stop": None}
        for s in chosen
    ]


def deployment_config(model: Path, redis_url: str) -> dict:
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    pools = {}
    for name, workers in CONTENDERS.items():
        pool = {"backend": "autoregressive", "model": str(model), "workers": workers, "max_queue": 256}
        if name.startswith("redis"):
            pool.update(transport="redis", redis_url=redis_url, redis={"prefix": prefix})
        pools[name] = pool
    return {"pools": pools, "policy": {"classifier": None, "default_pool": "inprocess_1"}}


def start_workers(config_path: Path, stack: ExitStack) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name, workers in CONTENDERS.items():
        if not name.startswith("redis"):
            continue
        for _ in range(workers):
            command = [sys.executable, "-m", "router", "worker", "--config", str(config_path), "--pool", name]
            process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            stack.callback(lambda p=process: (p.terminate(), p.wait(30)))


def stream_timing(router, pool: str, request: dict) -> dict[str, float]:
    started = time.perf_counter()
    arrivals = []
    for chunk in router.stream(**request, model=pool):
        if chunk.delta:
            arrivals.append(time.perf_counter())
    end = time.perf_counter()
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    return {
        "latency_s": end - started,
        "ttft_s": (arrivals[0] if arrivals else end) - started,
        "gap_s": statistics.median(gaps) if gaps else 0.0,
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def closed_loop(router, pool: str, batch: list[dict], concurrency: int) -> dict[str, float]:
    def one(request: dict) -> tuple[float, int]:
        started = time.perf_counter()
        result = router.complete(**request, model=pool)
        return time.perf_counter() - started, result.usage.completion_tokens

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as clients:
        outcomes = list(clients.map(one, batch))
    wall = time.perf_counter() - started
    latencies = [latency for latency, _ in outcomes]
    return {
        "requests_per_s": len(batch) / wall,
        "tokens_per_s": sum(tokens for _, tokens in outcomes) / wall,
        "p50_latency_ms": 1000 * percentile(latencies, 0.5),
        "p95_latency_ms": 1000 * percentile(latencies, 0.95),
    }


def run_benchmark(model: Path, count: int, max_tokens: int, concurrency: int, rounds: int) -> dict:
    from router import Router

    torch.set_num_threads(1)
    batch = requests(count, max_tokens)
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        url = stack.enter_context(local_redis())
        config_path = Path(tmp) / "router.yaml"
        config_path.write_text(yaml.safe_dump(deployment_config(model, url)))
        start_workers(config_path, stack)
        router = stack.enter_context(Router.from_config(config_path))
        router.warmup()
        wait_for_workers(router)
        for pool in CONTENDERS:  # warm-up: first requests pay for lazy initialisation
            router.complete(**batch[0], model=pool)
        sequential: dict[str, list[dict[str, float]]] = {pool: [] for pool in CONTENDERS}
        loops: dict[str, list[dict[str, float]]] = {pool: [] for pool in CONTENDERS}
        with JobProgress(log_every=10) as progress:
            job = progress.add_job("bench pools", total=len(batch) * len(CONTENDERS) + rounds * len(CONTENDERS))
            for request in batch:
                for pool in CONTENDERS:
                    sequential[pool].append(stream_timing(router, pool, request))
                    progress.step(job, status=f"sequential {pool}")
            for _ in range(rounds):
                for pool in CONTENDERS:
                    loops[pool].append(closed_loop(router, pool, batch, concurrency))
                    progress.step(job, status=f"concurrent {pool}")
    return report(model, batch, concurrency, rounds, sequential, loops)


def wait_for_workers(router, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    for name, workers in CONTENDERS.items():
        if name.startswith("redis"):
            while len(router.pools[name].live_workers()) < workers:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the workers of {name} did not come up in {timeout_s:g}s")
                time.sleep(0.1)


def report(model: Path, batch: list[dict], concurrency: int, rounds: int, sequential: dict, loops: dict) -> dict:
    def median_ms(runs: list[dict[str, float]], key: str) -> float:
        return 1000 * statistics.median(run[key] for run in runs)

    seq = {
        pool: {
            "p50_latency_ms": median_ms(runs, "latency_s"),
            "p95_latency_ms": 1000 * percentile([r["latency_s"] for r in runs], 0.95),
            "ttft_p50_ms": median_ms(runs, "ttft_s"),
            "chunk_gap_p50_ms": median_ms(runs, "gap_s"),
        }
        for pool, runs in sequential.items()
    }
    concurrent = {
        pool: {key: statistics.median(run[key] for run in runs) for key in runs[0]} for pool, runs in loops.items()
    }

    def paired_ms(key: str) -> float:
        """Median over requests of the Redis pool's time minus the in-process pool's on the same request: the
        requests' own spread (10x between a short and a long answer) cancels, which a difference of medians
        keeps."""
        pairs = zip(sequential["redis_1"], sequential["inprocess_1"], strict=True)
        return 1000 * statistics.median(hop[key] - base[key] for hop, base in pairs)

    return {
        "model": str(model),
        "requests": len(batch),
        "concurrency": concurrency,
        "rounds": rounds,
        "sequential": seq,
        "concurrent": concurrent,
        "redis_hop": {
            "per_request_ms": paired_ms("latency_s"),
            "ttft_ms": paired_ms("ttft_s"),
            "per_streamed_chunk_ms": paired_ms("gap_s"),
        },
    }


def print_table(result: dict) -> None:
    print(f"{'contender':<13} {'req/s':>7} {'tok/s':>7} {'p50 ms':>8} {'p95 ms':>8} {'seq p50':>8} {'gap ms':>7}")
    for pool in CONTENDERS:
        c, s = result["concurrent"][pool], result["sequential"][pool]
        print(
            f"{pool:<13} {c['requests_per_s']:>7.2f} {c['tokens_per_s']:>7.0f} {c['p50_latency_ms']:>8.1f}"
            f" {c['p95_latency_ms']:>8.1f} {s['p50_latency_ms']:>8.1f} {s['chunk_gap_p50_ms']:>7.2f}"
        )
    hop = result["redis_hop"]
    print(
        f"Redis hop: {hop['per_request_ms']:+.1f} ms per request, {hop['ttft_ms']:+.1f} ms to first token, "
        f"{hop['per_streamed_chunk_ms']:+.2f} ms per streamed chunk"
    )


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(CONTENDERS)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(names, [result["concurrent"][n]["tokens_per_s"] for n in names], color="tab:blue")
    left.set_ylabel("tokens / s")
    left.set_title(f"throughput, {result['concurrency']} concurrent clients")
    width = 0.4
    xs = range(len(names))
    right.bar(
        [x - width / 2 for x in xs], [result["concurrent"][n]["p50_latency_ms"] for n in names], width, label="p50"
    )
    right.bar(
        [x + width / 2 for x in xs], [result["concurrent"][n]["p95_latency_ms"] for n in names], width, label="p95"
    )
    right.set_xticks(list(xs), names)
    right.set_ylabel("latency, ms")
    right.set_title("latency")
    right.legend()
    for axis in (left, right):
        axis.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--requests", type=int, default=24, help="held-out subtasks per measurement")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=4, help="closed-loop clients")
    parser.add_argument("--rounds", type=int, default=3, help="closed-loop rounds per contender (median kept)")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--plot", type=Path, help="throughput and latency per contender, as PNG")


def run(args: argparse.Namespace) -> int:
    result = run_benchmark(args.model, args.requests, args.max_tokens, args.concurrency, args.rounds)
    print_table(result)
    write_json(args.json, result)
    if args.plot:
        plot(result, args.plot)
    return 0

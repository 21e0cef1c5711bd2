"""``dspark-router bench soak --minutes N``: the real gateway under steady load for a long time, with faults.

``dspark-router serve`` runs with three pools: ``dspark`` and ``standard`` in-process, ``remote`` a Redis worker
pool of ``--workers`` ``dspark-router worker`` processes on a private ``redis-server`` (never ``REDIS_URL``: the
soak stops and restarts it). Its capacity is measured first, ``--capacity-s`` seconds of a closed loop of the
mix; then the mix of :mod:`benchmarks.soak_clients` arrives open loop (Poisson) at ``--load`` of that for
``--minutes``. At a third of the run Redis is stopped for ``--outage-s`` seconds and started again, empty; at two
thirds a worker is ``kill -9``-ed and a replacement started. Reported (JSON and a plot over time): each
process's RSS, p50/p99 per minute (per 10 seconds for runs under 5 minutes), errors by status, requests lost or
duplicated. Targets in :data:`benchmarks.soak_report.TARGETS`.

Models: tiny random ones built into a temporary folder (seconds, deterministic: the soak tests the serving, not
the model), or ``--model default`` for the default model.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import yaml

from benchmarks.output import write_json

if TYPE_CHECKING:
    from benchmarks.soak_clients import Ask, Clients, Outcome
    from benchmarks.soak_faults import Processes

TINY = "tiny models built in a temporary folder"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=60.0, help="how long the driven load runs")
    p.add_argument("--model", default="tiny", help="'tiny' (built on the spot, the default), 'default' or a folder")
    p.add_argument("--load", type=float, default=0.8, help="share of the measured capacity to drive at")
    p.add_argument("--capacity-s", type=float, default=30.0, help="seconds of closed loop to measure capacity")
    p.add_argument("--concurrency", type=int, default=8, help="clients of the closed loop")
    p.add_argument("--workers", type=int, default=1, help="worker processes of the Redis pool")
    p.add_argument("--outage-s", type=float, default=5.0, help="how long Redis stays down")
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between RSS samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--traffic-max-tokens",
        type=int,
        help="the DSpark pool's traffic cache cap in tokens (default: the pool's); a small one is reached early, so "
        "the soak shows memory held at the cap while the oldest answers go (the cache drafts on --model default)",
    )
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--plot", type=Path, help="latency and RSS over time, as PNG")


def _tiny_models(folder: Path) -> dict[str, Path]:
    """A tiny random llama for the standard pools and the same weights with fresh span heads for DSpark."""
    from backends.autoregressive import AutoregressiveBackend
    from backends.dspark.model import DSparkModel
    from backends.modelfactory import build_model, save_pretrained, stdlib_texts, train_tokenizer

    tokenizer = train_tokenizer(stdlib_texts(), vocab_size=512)
    standard = save_pretrained(build_model("llama", tokenizer, seed=0), tokenizer, folder / "standard")
    DSparkModel.with_new_heads(AutoregressiveBackend.from_pretrained(standard).loaded, 3).save(folder / "dspark")
    return {"standard": standard, "dspark": folder / "dspark"}


def deployment(model: str, folder: Path, redis_url: str, traffic_max_tokens: int | None = None) -> dict[str, Any]:
    """One request at a time per pool (``max_batch: 1``): greedy answers then do not depend on what else is in
    the batch, so each request's answer is known in advance. ``traffic_max_tokens``: the DSpark pool's traffic cache
    cap."""
    if model == "tiny":
        paths = _tiny_models(folder)
        dspark: dict[str, Any] = {"model": str(paths["dspark"])}
        standard = str(paths["standard"])
    else:
        dspark, standard = {"model": model, **({"drafter_path": "default"} if model == "default" else {})}, model
    one = {"workers": 1, "max_batch": 1, "max_queue": 64, "timeout_s": 60}
    redis = {"prefix": f"soak-{uuid.uuid4().hex[:8]}", "visibility_timeout_s": 3.0, "heartbeat_s": 0.5}
    if traffic_max_tokens is not None:
        dspark["traffic"] = {"max_tokens": traffic_max_tokens}
    return {
        "pools": {
            "dspark": {"backend": "dspark", **dspark, **one},
            "standard": {"backend": "autoregressive", "model": standard, **one},
            "remote": {"backend": "autoregressive", "model": standard, "transport": "redis", "redis_url": redis_url}
            | {"max_batch": 1, "max_queue": 64, "timeout_s": 60, "redis": redis},
        },
        "policy": {"classifier": None, "default_pool": "standard"},
        "gateway": {"api_keys_env": None, "max_concurrency": 256},
    }


async def _closed_loop(clients: Clients, asks: Iterator[Ask], seconds: float, concurrency: int) -> float:
    """Requests per second of ``concurrency`` clients sending the mix back to back."""
    done, until = 0, time.perf_counter() + seconds

    async def client() -> None:
        nonlocal done
        while time.perf_counter() < until:
            await clients.send(next(asks))
            done += 1

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return done / (time.perf_counter() - started)


async def _sample(
    processes: Processes, clients: Clients, started: float, every_s: float, samples: list[dict[str, Any]]
) -> None:
    """Every process's RSS and what the gateway's pools' caches hold (its /metrics), every ``every_s``."""
    while True:
        rss = processes.rss_mb()
        samples.append({"t_s": time.perf_counter() - started, "rss_mb": rss, "cache_mb": await _cache_mb(clients)})
        await asyncio.sleep(every_s)


async def _cache_mb(clients: Clients) -> dict[str, float]:
    """``dspark_router_cache_bytes`` from the gateway's /metrics, in MB by ``pool/cache`` (empty while the gateway
    does not answer, as during a restart)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = (await clients.http.get("/metrics", timeout=5.0)).text
    except httpx.HTTPError:
        return {}
    held = next((f for f in text_string_to_metric_families(text) if f.name == "dspark_router_cache_bytes"), None)
    samples = held.samples if held is not None else []
    return {f"{s.labels['pool']}/{s.labels['cache']}": s.value / 1e6 for s in samples if s.value}


async def _faults(processes: Processes, started: float, seconds: float, outage_s: float) -> None:
    await asyncio.sleep(seconds / 3)
    await asyncio.to_thread(processes.restart_redis, time.perf_counter() - started, outage_s)
    await asyncio.sleep(max(0.0, started + 2 * seconds / 3 - time.perf_counter()))
    await asyncio.to_thread(processes.kill_worker, time.perf_counter() - started)


async def _progress(outcomes: list[Outcome], started: float, seconds: float) -> None:
    """A line every tenth of the run (at most every minute): how far, how many answered, how many lost."""
    every = min(60.0, max(5.0, seconds / 10))
    while True:
        await asyncio.sleep(every)
        elapsed = time.perf_counter() - started
        lost = sum(o.lost for o in outcomes)
        stage = f"{elapsed:6.0f}s / {seconds:.0f}s" if elapsed < seconds else f"{elapsed:6.0f}s, draining"
        print(f"soak {stage}: {len(outcomes)} answered, {lost} lost", flush=True)


async def _drive(
    clients: Clients, processes: Processes, args: argparse.Namespace, report: dict[str, Any]
) -> dict[str, Any]:
    from benchmarks.soak_clients import Outcome, mix
    from benchmarks.soak_report import build

    await clients.references_for_all()
    asks = mix(args.seed)
    capacity = await _closed_loop(clients, asks, args.capacity_s, args.concurrency)
    rate, seconds = args.load * capacity, 60 * args.minutes
    print(f"capacity {capacity:.1f} req/s; driving {rate:.1f} req/s for {seconds:.0f}s", flush=True)
    outcomes: list[Outcome] = []
    samples: list[dict[str, Any]] = []
    started = clients.clock = time.perf_counter()
    background = [
        asyncio.create_task(_sample(processes, clients, started, args.sample_s, samples)),
        asyncio.create_task(_progress(outcomes, started, seconds)),
    ]
    faults = asyncio.create_task(_faults(processes, started, seconds, args.outage_s))
    arrivals, pending, sent = random.Random(args.seed), set(), []
    next_at = started
    while next_at < started + seconds:
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        ask = next(asks)
        sent.append(ask)
        task = asyncio.create_task(clients.send(ask))
        task.add_done_callback(lambda t: t.cancelled() or outcomes.append(t.result()))
        pending.add(task)
        task.add_done_callback(pending.discard)
        next_at += arrivals.expovariate(rate)
    await faults
    if pending:
        await asyncio.wait(pending, timeout=120)
    answered = {o.id for o in outcomes}
    outcomes += [Outcome(a.id, a.kind, 0.0, "lost:no outcome by the end") for a in sent if a.id not in answered]
    for task in [*background, *pending]:
        task.cancel()
    report.update(exit_codes=processes.exit_codes(), log_tails=processes.log_tails())
    report.update(capacity_rps=capacity, rate_rps=rate, seconds=seconds, bucket_s=60.0 if seconds >= 300 else 10.0)
    return build(outcomes, samples, processes.faults, report)


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.local_redis import LocalRedis
    from benchmarks.soak_clients import Clients
    from benchmarks.soak_faults import Processes

    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        folder = Path(tmp)
        redis = LocalRedis(folder)
        config = folder / "router.yaml"
        config.write_text(yaml.safe_dump(deployment(args.model, folder, redis.url, args.traffic_max_tokens)))
        processes = Processes(config, folder, redis, "remote")
        report = {"model": TINY if args.model == "tiny" else args.model, "cpus": os.cpu_count(), "load": args.load}
        try:
            base = processes.start(args.workers)

            async def soak() -> dict[str, Any]:
                clients = Clients(base)
                try:
                    return await _drive(clients, processes, args, report)
                finally:
                    await clients.close()

            return asyncio.run(soak())
        finally:
            processes.close()


def run(args: argparse.Namespace) -> int:
    from benchmarks.soak_report import plot, show

    report = run_benchmark(args)
    show(report)
    write_json(args.json, report)
    if args.plot:
        print(f"wrote {plot(report, args.plot)}")
    return 0

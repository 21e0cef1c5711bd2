"""Benchmarks, run as ``dspark-router bench NAME``.

A benchmark is a module with ``add_arguments(parser)`` and ``run(args) -> exit code``, listed in
:data:`BENCHMARKS` with a one-line help. To add ``bench NAME``: import ``benchmarks.NAME`` here and add
``"NAME": Benchmark("one-line help", NAME.add_arguments, NAME.run)``. Every CLI invocation builds all the
parsers, so a benchmark module should be cheap to import (torch is loaded anyway; leave the rest to ``run``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NamedTuple

from benchmarks import (
    batching,
    copies,
    decode,
    engine,
    fleet,
    gateway,
    pools,
    quality,
    route,
    soak,
    structured,
    suite,
    workload,
)


class Benchmark(NamedTuple):
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


BENCHMARKS: dict[str, Benchmark] = {
    "engine": Benchmark(
        "a forward's cost by tokens in it on each engine (packed GGUF blocks, transformers), beside the weight-read "
        "floor",
        engine.add_arguments,
        engine.run,
    ),
    "decode": Benchmark(
        "DSpark with each drafter against plain decoding and transformers' fast paths, interleaved on one model",
        decode.add_arguments,
        decode.run,
    ),
    "copies": Benchmark(
        "copied blocks replayed on the target's greedy corpus answers, timed on every stored cost curve, beside "
        "transformers' prompt lookup",
        copies.add_arguments,
        copies.run,
    ),
    "structured": Benchmark(
        "JSON-schema-constrained generation on real schemas, outputs validated, both backends",
        structured.add_arguments,
        structured.run,
    ),
    "batching": Benchmark(
        "batched pools against one request at a time and transformers serve: throughput vs per-request speed",
        batching.add_arguments,
        batching.run,
    ),
    "pools": Benchmark(
        "Redis worker pools against in-process pools: throughput, latency, the cost of the Redis hop",
        pools.add_arguments,
        pools.run,
    ),
    "quality": Benchmark(
        "answer quality on held-out subtasks: exact answers, JSON fields, code that parses, tool arguments",
        quality.add_arguments,
        quality.run,
    ),
    "route": Benchmark(
        "routing quality (AUROC, time saved vs an oracle) and scoring latency of the determinism classifier",
        route.add_arguments,
        route.run,
    ),
    "workload": Benchmark(
        "a mixed agent workload arriving open loop at rising rates, through the router under each policy",
        workload.add_arguments,
        workload.run,
    ),
    "fleet": Benchmark(
        "the shipped policy on a simulated fleet (a discrete-event simulation): latency and throughput from light "
        "load to past saturation, against single pools and an oracle",
        fleet.add_arguments,
        fleet.run,
    ),
    "gateway": Benchmark(
        "the REST gateway's added latency, time to first token and /v1/route throughput, against in-process calls",
        gateway.add_arguments,
        gateway.run,
    ),
    "all": Benchmark(
        "every benchmark above with the published arguments, then BENCHMARKS.md from their JSON (make bench)",
        suite.add_arguments,
        suite.run,
    ),
    "soak": Benchmark(
        "the gateway with in-process and Redis worker pools for --minutes at 80 percent of capacity, Redis "
        "restarted and a worker killed midway: RSS, latency over time, errors, requests lost or duplicated (not in "
        "make bench)",
        soak.add_arguments,
        soak.run,
    ),
}


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """The ``bench`` subcommand, one sub-subcommand per entry of :data:`BENCHMARKS`."""
    p = sub.add_parser("bench", help="run a benchmark")
    benches = p.add_subparsers(dest="benchmark", required=True)
    for name, bench in BENCHMARKS.items():
        parser = benches.add_parser(name, help=bench.help, description=bench.help)
        bench.add_arguments(parser)
        parser.set_defaults(handler=bench.run)

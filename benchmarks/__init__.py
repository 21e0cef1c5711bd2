"""Benchmarks, run as ``dspark-router bench NAME``.

A benchmark is a module with ``add_arguments(parser)`` and ``run(args) -> exit code``, listed in
:data:`BENCHMARKS` with a one-line help. To add ``bench NAME``: add ``"NAME": Subcommand("one-line help",
"benchmarks.NAME")``. A benchmark's module is imported only when it runs (or shows its own help), so ``bench
--help`` and the rest of the console command do not load torch or any other benchmark's stack.
"""

from __future__ import annotations

import argparse

from router.subcommands import Subcommand, add_subcommands

BENCHMARKS: dict[str, Subcommand] = {
    "engine": Subcommand(
        "a forward's cost by tokens in it on each engine (packed GGUF blocks, transformers), beside the weight-read "
        "floor",
        "benchmarks.engine",
    ),
    "decode": Subcommand(
        "DSpark with each drafter against plain decoding and transformers' fast paths, interleaved on one model",
        "benchmarks.decode",
    ),
    "copies": Subcommand(
        "copied blocks replayed on the target's greedy corpus answers, timed on every stored cost curve, beside "
        "transformers' prompt lookup",
        "benchmarks.copies",
    ),
    "structured": Subcommand(
        "JSON-schema-constrained generation on real schemas, outputs validated, both backends",
        "benchmarks.structured",
    ),
    "batching": Subcommand(
        "batched pools against one request at a time and transformers serve: throughput vs per-request speed",
        "benchmarks.batching",
    ),
    "pools": Subcommand(
        "Redis worker pools against in-process pools: throughput, latency, the cost of the Redis hop",
        "benchmarks.pools",
    ),
    "quality": Subcommand(
        "answer quality on held-out subtasks: exact answers, JSON fields, code that parses, tool arguments",
        "benchmarks.quality",
    ),
    "route": Subcommand(
        "routing quality (AUROC, time saved vs an oracle) and scoring latency of the determinism classifier",
        "benchmarks.route",
    ),
    "workload": Subcommand(
        "a mixed agent workload arriving open loop at rising rates, through the router under each policy",
        "benchmarks.workload",
    ),
    "fleet": Subcommand(
        "the shipped policy on a simulated fleet (a discrete-event simulation): latency and throughput from light "
        "load to past saturation, against single pools and an oracle",
        "benchmarks.fleet",
    ),
    "gateway": Subcommand(
        "the REST gateway's added latency, time to first token and /v1/route throughput, against in-process calls",
        "benchmarks.gateway",
    ),
    "trace": Subcommand(
        "an agent's trace job by job through the gateway: the DSpark pool, drafting from its earlier answers, "
        "against the standard pool by position within a job",
        "benchmarks.trace",
    ),
    "all": Subcommand(
        "every benchmark above with the published arguments, then BENCHMARKS.md from their JSON (make bench)",
        "benchmarks.suite",
    ),
    "soak": Subcommand(
        "the gateway with in-process and Redis worker pools for --minutes at 80 percent of capacity, Redis "
        "restarted and a worker killed midway: RSS, latency over time, errors, requests lost or duplicated (not in "
        "make bench)",
        "benchmarks.soak",
    ),
}


def add_bench(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` subcommand, one sub-subcommand per entry of :data:`BENCHMARKS`."""
    add_subcommands(parser, BENCHMARKS, "benchmark")

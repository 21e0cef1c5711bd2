"""``dspark-router bench all``: every benchmark with the arguments of the published run, then BENCHMARKS.md.

The list below is the one place that says how the published numbers were made: ``make bench`` runs it, and the
report (:mod:`benchmarks.report`) prints the same commands beside the tables. Each benchmark runs in a process
of its own, so none inherits another's threads, caches or loaded models, and one that fails is reported and
does not stop the others.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks import report

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PROMPTS = "../shared/data/prompts"
SUITE_FILE = "suite.json"


@dataclass(frozen=True)
class Step:
    name: str
    """The step's name: its report section's, its results' file name's, and the benchmark's unless ``bench`` says."""
    arguments: tuple[str, ...]
    """With ``{results}`` for the results folder."""
    bench: str | None = None
    """The benchmark it runs, where one benchmark is a step twice on different workloads."""

    def argv(self, results: Path) -> list[str]:
        return [argument.format(results=results) for argument in self.arguments]

    def subcommand(self) -> str:
        return self.bench or self.name

    def command(self) -> str:
        """As a person would type it from the repository root."""
        shown = self.argv(Path("benchmarks/results"))
        return " ".join(["dspark-router", "bench", self.subcommand(), *shown])


SUITE: tuple[Step, ...] = (
    Step("engine", ("--json", "{results}/engine.json", "--plot", "{results}/engine.png")),
    Step("quality", ("--per-kind", "3", "--json", "{results}/quality.json")),
    Step(
        "decode",
        (
            *("--prompts", PROMPTS, "--per-set", "3", "--sampled-sets", "humaneval,mbpp", "--per-category", "3"),
            *("--json", "{results}/decode.json", "--plots", "{results}/decode"),
        ),
    ),
    Step("copies", ("--json", "{results}/copies.json", "--plots", "{results}/copies")),
    Step("structured", ("--limit", "16", "--max-tokens", "160", "--json", "{results}/structured.json")),
    Step("route", ("--json", "{results}/route.json", "--plot", "{results}/route.png")),
    Step(
        "batching",
        (
            *("--prompts", PROMPTS, "--per-set", "3", "--window", "10", "--concurrency", "1,4,16"),
            *("--json", "{results}/batching.json", "--plot", "{results}/batching.png"),
        ),
    ),
    Step(
        "batching-trace",
        (
            *("--mix", "trace", "--per-set", "40", "--window", "10", "--concurrency", "4,16"),
            *("--contenders", "batched,dspark_scheduled"),
            *("--json", "{results}/batching-trace.json", "--plot", "{results}/batching-trace.png"),
        ),
        bench="batching",
    ),
    Step("workload", ("--json", "{results}/workload.json", "--plots", "{results}/workload")),
    Step("fleet", ("--json", "{results}/fleet.json", "--plots", "{results}/fleet")),
    Step(
        "pools", ("--requests", "8", "--rounds", "2", "--json", "{results}/pools.json", "--plot", "{results}/pools.png")
    ),
    Step("gateway", ("--requests", "60", "--json", "{results}/gateway.json")),
    Step("trace", ("--json", "{results}/trace.json", "--plot", "{results}/trace.png")),
    Step(
        "trace-redis",
        (
            *("--redis-workers", "2", "--no-auto", "--no-llama-lookup", "--peer-requests", "0"),
            *("--json", "{results}/trace-redis.json", "--plot", "{results}/trace-redis.png"),
        ),
        bench="trace",
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--results", type=Path, default=RESULTS, help="where every benchmark writes its JSON")
    parser.add_argument("--only", help="comma-separated benchmarks to run (default: all)")
    parser.add_argument("--report", type=Path, default=REPO / "BENCHMARKS.md", help="the report to write")
    parser.add_argument("--report-only", action="store_true", help="write the report from the results there")


def run(args: argparse.Namespace) -> int:
    chosen = set(args.only.split(",")) if args.only else {step.name for step in SUITE}
    unknown = chosen - {step.name for step in SUITE}
    if unknown:
        raise SystemExit(f"unknown benchmarks: {', '.join(sorted(unknown))}")
    args.results.mkdir(parents=True, exist_ok=True)
    record_file = args.results / SUITE_FILE
    runs = json.loads(record_file.read_text()) if record_file.is_file() else {}
    failed = []
    if not args.report_only:
        machine, weights = report.machine(), report.weights_id()
        for step in (s for s in SUITE if s.name in chosen):
            print(f"== bench {step.name}", flush=True)
            started = time.perf_counter()
            command = [sys.executable, "-m", "router", "bench", step.subcommand(), *step.argv(args.results)]
            code = subprocess.call(command)
            runs.setdefault("benchmarks", {})[step.name] = {
                "command": step.command(),
                "seconds": round(time.perf_counter() - started, 1),
                "exit_code": code,
                "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "weights": weights,
                "machine": machine,
            }
            record_file.write_text(json.dumps(runs, indent=2) + "\n")
            if code != 0:
                failed.append(step.name)
    args.report.write_text(report.render(args.results, runs, args.report.parent))
    print(f"wrote {args.report}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0

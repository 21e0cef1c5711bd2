"""``dspark-router calibrate``: measure DSpark against the standard pool per subtask, and (re)train the classifier.

Registered in ``router/cli.py``, which imports this module only when it runs.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from rich.console import Console

from backends.corpus.subtasks import read_jsonl
from backends.default_model import drafters_for
from backends.dspark.curves import stored_curves
from backends.errors import InvalidRequestError
from backends.scheduling import PROFILE_FILE
from classifiers import DEFAULT_CLASSIFIER, DEFAULT_MARGIN, DEFAULT_MEASUREMENTS
from classifiers.calibrate import (
    MAX_TOKENS,
    REPEATS,
    SAMPLES,
    carried_to,
    load_pools,
    machine_profile,
    measure_with_progress,
    measured_on,
    summary_table,
)
from classifiers.corpus import CORPUS_PATH, template_splits
from classifiers.records import Measurement, read_measurements, write_measurements

SAMPLE_SEED = 1


def add_calibrate(p: argparse.ArgumentParser) -> None:
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="DSpark model folder: measure the corpus on it")
    source.add_argument(
        "--from-log",
        metavar="FILE|redis://...",
        help="retrain from measurement records: a JSONL file, or a Redis stream (redis://host:port/db#stream)",
    )
    p.add_argument("--stream", help="Redis stream name for --from-log, when the URL has no #fragment")
    p.add_argument(
        "--measured-with",
        metavar="MODEL",
        help="with --from-log: the log was measured with this model, on the machine its records name (else on "
        "this one); store that machine's cost curve with the classifier, so routers on other machines can carry "
        "the speedups over; where the records name several machines, carry theirs to the one most name",
    )
    p.add_argument("--corpus", default=str(CORPUS_PATH), help="subtasks JSONL (default: the shipped corpus)")
    p.add_argument(
        "--measurements",
        default=str(DEFAULT_MEASUREMENTS),
        help="where to write the measurements, one line per subtask as it is measured (an interrupted run keeps "
        "what it measured: train on it with --from-log)",
    )
    p.add_argument("--out", default=str(DEFAULT_CLASSIFIER), help="where to save the classifier")
    p.add_argument("--limit", type=int, help="measure only the first N subtasks of the corpus")
    p.add_argument(
        "--sample",
        type=int,
        help="measure a seeded random N of the corpus instead (the retest that bench route's noise ceiling reads)",
    )
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="cap on each subtask's max_tokens")
    p.add_argument("--repeats", type=int, default=REPEATS, help="runs per subtask, seed and pool; the fastest is kept")
    p.add_argument(
        "--samples",
        type=int,
        default=SAMPLES,
        help="seeds per sampled subtask (temperature > 0); speedup over all of them",
    )
    p.add_argument(
        "--margin", type=float, default=DEFAULT_MARGIN, help=f"label: speedup >= margin (default {DEFAULT_MARGIN})"
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the measurements already in the file and measure only the subtasks it does not hold",
    )
    p.add_argument("--measure-only", action="store_true", help="write the measurements, do not train")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.set_defaults(handler=_calibrate)


def _measure(args: argparse.Namespace, console: Console) -> tuple[list[Measurement], dict | None]:
    """The measurements, and the calibration profile of the machine they were taken on."""
    if not Path(args.corpus).is_file():
        raise InvalidRequestError(f"no corpus file at {args.corpus!r}", param="corpus")
    counts = (args.limit, args.sample, args.max_tokens, args.repeats, args.samples)
    if any(count is not None and count < 1 for count in counts):
        raise InvalidRequestError(
            "--limit, --sample, --max-tokens, --repeats and --samples must be >= 1", param="limit"
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    subtasks = read_jsonl(args.corpus)
    splits = template_splits(subtasks)  # the whole corpus, so --limit keeps a full run's splits
    if args.sample is not None:
        subtasks = list(subtasks)
        random.Random(SAMPLE_SEED).shuffle(subtasks)
        subtasks = subtasks[: args.sample]
    chosen = [(subtask, splits[subtask.template]) for subtask in subtasks[: args.limit]]
    records: list[Measurement] = []
    if args.resume and Path(args.measurements).is_file():
        records, _ = read_measurements(args.measurements)
        done = {record.canonical_request() for record in records}
        chosen = [
            (s, split)
            for s, split in chosen
            if Measurement(request=s.to_request_dict()).canonical_request() not in done
        ]
        console.print(f"resuming: {len(records)} measured already, {len(chosen)} to measure")
    started = time.perf_counter()
    pools = load_pools(args.model, args.device, args.dtype)

    def measured() -> Iterator[Measurement]:
        for record in measure_with_progress(pools, chosen, args.max_tokens, args.repeats, args.samples, console):
            records.append(record)
            yield record

    path = write_measurements(measured(), args.measurements, append=args.resume)
    console.print(summary_table(records, args.margin, time.perf_counter() - started))
    console.print(f"measurements written to {path}")
    return records, machine_profile(args.model, measured_on(records), args.device, args.dtype)


def _on_one_machine(records: list[Measurement], model: str | None, console: Console) -> list[Measurement]:
    """Records measured on several machines (a decision log gathered across a fleet, a corpus resumed on another
    machine) with every speedup carried to the machine most of them name, by the cost curves stored with
    ``model``'s drafters: speedups from a bfloat16 machine with AMX and a float32 one differ twofold, so a
    classifier fitted on both as measured would learn the machines, not the requests."""
    machines = sorted({r.machine for r in records if r.speedup is not None and r.machine is not None})
    if len(machines) < 2:
        return records
    if model is None:
        raise InvalidRequestError(
            f"the records were measured on {len(machines)} machines ({'; '.join(machines)}): pass --measured-with "
            "MODEL to carry their speedups to one machine by the cost curves stored with its drafters",
            param="measured_with",
        )
    target = measured_on(records)
    curves = stored_curves(drafters_for(model) / PROFILE_FILE)
    if target not in curves:
        raise InvalidRequestError(
            f"no cost curve of {target} is stored with {model}'s drafters, so no speedup can be carried to it",
            param="measured_with",
        )
    kept, carried, left_out = carried_to(records, target, curves)
    for machine, count in carried.items():
        console.print(f"carried {count} speedups from {machine} to {target}")
    for machine, count in left_out.items():
        console.print(f"[yellow]left out {count} records of {machine}: no cost curve of it is stored")
    return kept


def _calibrate(args: argparse.Namespace) -> int:
    from classifiers.train import train

    console = Console(stderr=True)
    started = time.perf_counter()
    if args.from_log and args.measure_only:
        raise InvalidRequestError("--measure-only needs --model: a log is measured already", param="measure_only")
    if args.from_log:
        records, rejected = read_measurements(args.from_log, args.stream)
        for note in rejected[:5]:
            console.print(f"[yellow]rejected {note}")
        unmeasured = sum(record.speedup is None for record in records)
        console.print(f"{len(records)} records read ({len(rejected)} rejected, {unmeasured} without a speedup)")
        profile = (
            machine_profile(args.measured_with, measured_on(records), args.device, args.dtype)
            if args.measured_with
            else None
        )
    else:
        records, profile = _measure(args, console)
    summary: dict = {"records": len(records), "measurements": None if args.from_log else args.measurements}
    if not args.measure_only:
        records = _on_one_machine(records, args.measured_with if args.from_log else args.model, console)
        classifier = train(records, args.margin, profile)
        summary |= {"classifier": str(classifier.save(args.out)), **classifier.info}
        console.print(f"classifier saved to {args.out}")
    summary["elapsed_s"] = round(time.perf_counter() - started, 2)
    console.print(f"total runtime {summary['elapsed_s']:.1f} s")
    print(json.dumps(summary))
    return 0

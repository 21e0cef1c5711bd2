"""``python -m benchmarks.gpu.serve RESULTS``: the DSpark pool on a GPU, measured in one command of under 10 minutes.

Stages, each written into RESULTS as it ends (:mod:`benchmarks.gpu.stages`): the check that fails in seconds
(:mod:`benchmarks.gpu.preflight`); the default model rebuilt from its GGUF (the cargo's, put together by
:mod:`benchmarks.gpu.cargo`); the target's cost curve on the device, by forward length up to the largest batch
measured (``dspark_sps.json``, which a fleet profile and the router read); ``bench decode`` on held-out subtasks
(greedy mismatches, tokens a forward, DSpark against our own AR on the same device: the evaluation prompts stay
on this side); and ``bench batching`` at 1 to 64 concurrent requests. Returned: ``summary.json``, ``log.txt``,
``dspark_sps.json``, ``decode.json``, ``batching.json``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from benchmarks.gpu.cargo import STORE
from benchmarks.gpu.stages import Stages

PROFILE_FILE = "dspark_sps.json"


def model_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the model comes from, shared by both scripts."""
    parser.add_argument("results", type=Path, help="the folder results are written to ($OUT on the machine)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--gguf", type=Path, help="the model file (default: the cargo's, else the installed wheel's)")
    parser.add_argument("--sha256", help="its expected digest (default: the default model's, for its file)")
    parser.add_argument("--model", type=Path, help="the folder to convert it into (default: the default model's)")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds the whole script may take")


def rebuild_model(stages: Stages, args: argparse.Namespace) -> Path | None:
    """The preflight and the model's conversion from its GGUF; the model's folder, or None where either failed."""
    from backends.default_model import DEFAULT_MODEL, GGUF_FILE, GGUF_SHA256

    gguf = args.gguf or (STORE / GGUF_FILE if (STORE / GGUF_FILE).is_file() else None)
    if gguf is None:
        from backends.convert import packaged_gguf

        gguf = packaged_gguf()
    sha256 = args.sha256 or (GGUF_SHA256 if gguf.name == GGUF_FILE else None)
    check = ["--sha256", sha256] if sha256 else []
    model = args.model or DEFAULT_MODEL
    if not stages.run("preflight", ["-m", "benchmarks.gpu.preflight", "--device", args.device, "--gguf", str(gguf)]):
        return None
    if not stages.run("model", ["-m", "router", "convert", str(gguf), "--output", str(model), *check]):
        return None
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu.serve", description=__doc__)
    model_arguments(parser)
    parser.add_argument("--drafters", type=Path, help="the drafters' folder (default: the model's)")
    parser.add_argument("--per-category", type=int, default=4, help="held-out subtasks per category, bench decode")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", default="1,4,16,64", help="bench batching's levels")
    parser.add_argument("--window", type=float, default=15.0, help="bench batching's seconds per contender and level")
    args = parser.parse_args(argv)
    from backends.default_model import drafters_for

    stages = Stages(args.results, args.budget)
    model = rebuild_model(stages, args)
    if model is None:
        return 1
    drafters = args.drafters or drafters_for(model)
    results, device = args.results, args.device
    longest = max(int(level) for level in args.concurrency.split(",")) * 8  # a batch of anchors plus 7 drafted
    curve = ["-m", "backends.dspark.profile", str(model), "--device", device, "--max-tokens", str(longest)]
    if stages.run("cost_curve", [*curve, "--into", str(drafters)], reserve_s=240):
        shutil.copy2(drafters / PROFILE_FILE, results / PROFILE_FILE)
    decode = ["-m", "router", "bench", "decode", "--model", str(model), "--drafter-path", str(drafters)]
    decode += ["--device", device, "--per-category", str(args.per_category), "--max-tokens", str(args.max_tokens)]
    stages.run("decode", [*decode, "--json", str(results / "decode.json")], reserve_s=120)
    batching = ["-m", "router", "bench", "batching", "--model", str(model), "--device", device]
    batching += ["--concurrency", args.concurrency, "--window", str(args.window), "--max-tokens", str(args.max_tokens)]
    batching += ["--contenders", "batched,sequential,dspark_scheduled,dspark_fixed"]
    stages.run("batching", [*batching, "--json", str(results / "batching.json")])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The ``dspark-router`` console command: one entry point, a subcommand per job.

Each subcommand's module loads only when it runs (:mod:`router.subcommands`): ``--help``, ``route`` and ``score``
start without torch, transformers or the benchmarks.
"""

from __future__ import annotations

import argparse
import json
import sys

from router.subcommands import Subcommand, add_subcommands


def add_generate(p: argparse.ArgumentParser) -> None:
    from backends.default_model import DEFAULT_MODEL

    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="a Hugging Face model folder (default: the default)")
    p.add_argument(
        "--backend",
        choices=["ar", "dspark"],
        default="ar",
        help="ar: plain autoregressive decoding; dspark: speculative decoding with a drafter (default: ar)",
    )
    p.add_argument("--drafter", choices=["heads", "dspark"], help="dspark backend: which drafter (default: the pool's)")
    p.add_argument(
        "--drafter-path",
        help="dspark backend: the drafters' folder (default: the default model's drafters for the default model, "
        "else the model's own folder)",
    )
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=None, help="default: OpenAI's 1.0; 0 decodes greedily")
    p.add_argument("--top-p", type=float, default=None, help="default: OpenAI's 1.0")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable, at most 4)")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--json", action="store_true", help="print one JSON object with the whole result")
    p.set_defaults(handler=_generate)


def _generate(args: argparse.Namespace) -> int:
    from backends.types import GenerationRequest

    fields = {"messages": [{"role": "user", "content": args.prompt}]} if args.chat else {"prompt": args.prompt}
    sampling = {"temperature": args.temperature, "top_p": args.top_p}
    request = GenerationRequest(
        **fields,
        **{name: value for name, value in sampling.items() if value is not None},
        max_tokens=args.max_tokens,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
    )
    if args.backend == "dspark":
        from backends.dspark.backend import DSparkBackend

        backend = DSparkBackend.from_pretrained(
            args.model, device=args.device, dtype=args.dtype, drafter=args.drafter, drafter_path=args.drafter_path
        )
    else:
        from backends.autoregressive import AutoregressiveBackend

        backend = AutoregressiveBackend.from_pretrained(args.model, device=args.device, dtype=args.dtype)
    if args.json:
        print(backend.complete(request).model_dump_json())
        return 0
    for chunk in backend.stream(request):
        sys.stdout.write(chunk.delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def add_tune(p: argparse.ArgumentParser) -> None:
    from backends.default_model import DEFAULT_MODEL

    p.add_argument("--model", default=str(DEFAULT_MODEL), help="the target model folder (default: the default)")
    p.add_argument("--drafter-path", help="the span heads' folder (default: the model's drafters)")
    p.add_argument("--prompts", type=int, default=24, help="validation chat subtasks")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=0, help="the engine's threads, and torch's (0: their defaults)")
    p.add_argument("--write", action="store_true", help="save the winner in the heads' dspark_config.json")
    p.set_defaults(handler=_tune)


def _tune(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from backends.default_model import drafters_for
    from backends.dspark.backend import DSparkBackend
    from backends.dspark.tuning import tune_thresholds, validation_requests

    if args.threads:
        torch.set_num_threads(args.threads)
    backend = DSparkBackend.from_pretrained(
        args.model, device="cpu", drafter="heads", drafter_path=args.drafter_path, threads=args.threads or None
    )
    best, timings = tune_thresholds(backend, validation_requests(args.prompts, args.max_tokens))
    print(json.dumps({"best": best, "timings": timings}, indent=2))
    if args.write:
        config = backend.model.dspark_config
        config.thresholds = best
        config.save(Path(args.drafter_path or drafters_for(args.model)))
    return 0


COMMANDS: dict[str, Subcommand] = {
    "generate": Subcommand("generate a completion with a local model", "router.cli", "add_generate", None),
    "convert": Subcommand(
        "convert a GGUF file into a Hugging Face model folder (default: the embedded default model)",
        "backends.convert",
        "add_convert",
        None,
    ),
    "train": Subcommand(
        "train the drafters on a frozen target (data, heads, dspark, measure, export)",
        "backends.training.commands",
        "add_train",
        None,
    ),
    "tune": Subcommand(
        "pick a DSpark model's span thresholds by measured speed (exact mode)", "router.cli", "add_tune", None
    ),
    "score": Subcommand(
        "score a subtask: P(DSpark beats the standard pool by the margin), and its expected speedup",
        "classifiers.score_command",
        "add_score",
        None,
    ),
    "calibrate": Subcommand(
        "measure DSpark's speedup per subtask and train the determinism classifier (or retrain from a log)",
        "classifiers.commands",
        "add_calibrate",
        None,
    ),
    "bench": Subcommand("run a benchmark", "benchmarks", "add_bench", None),
    "route": Subcommand(
        "show the routing decision for a request (or, with --generate, run it)", "router.commands", "add_route", None
    ),
    "serve": Subcommand(
        "serve the OpenAI-compatible REST gateway (FastAPI on uvicorn)", "router.gateway.serve", "add_serve", None
    ),
    "worker": Subcommand(
        "serve one pool's jobs from Redis (a pool with transport: redis)", "router.worker", "add_worker", None
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark-router", description=__doc__.split("\n")[0])
    add_subcommands(parser, COMMANDS, "command")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except Exception as exc:
        from backends.errors import DSparkRouterError

        if not isinstance(exc, DSparkRouterError):
            raise
        print(json.dumps(exc.to_openai()), file=sys.stderr)
        return 2

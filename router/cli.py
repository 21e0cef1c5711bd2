"""The ``dspark-router`` console command: one entry point, a subcommand per job."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from backends.convert import add_convert
from backends.default_model import DEFAULT_MODEL, drafters_for
from backends.errors import DSparkRouterError
from backends.training.commands import COMMANDS as TRAINING_COMMANDS
from benchmarks import add_bench_parser
from classifiers.commands import COMMANDS as CLASSIFIER_COMMANDS
from router.commands import add_route
from router.gateway.serve import add_serve
from router.worker import add_worker

Handler = Callable[[argparse.Namespace], int]


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate a completion with a local model")
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


def _add_tune(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tune", help="pick a DSpark model's span thresholds by measured speed (exact mode)")
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="the target model folder (default: the default)")
    p.add_argument("--drafter-path", help="the span heads' folder (default: the model's drafters)")
    p.add_argument("--prompts", type=int, default=24, help="validation chat subtasks")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--write", action="store_true", help="save the winner in the heads' dspark_config.json")
    p.set_defaults(handler=_tune)


def _tune(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from backends.dspark.backend import DSparkBackend
    from backends.dspark.tuning import tune_thresholds, validation_requests

    if args.threads:
        torch.set_num_threads(args.threads)
    backend = DSparkBackend.from_pretrained(args.model, device="cpu", drafter="heads", drafter_path=args.drafter_path)
    best, timings = tune_thresholds(backend, validation_requests(args.prompts, args.max_tokens))
    print(json.dumps({"best": best, "timings": timings}, indent=2))
    if args.write:
        config = backend.model.dspark_config
        config.thresholds = best
        config.save(Path(args.drafter_path or drafters_for(args.model)))
    return 0


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_generate,
    add_convert,
    *TRAINING_COMMANDS,
    _add_tune,
    *CLASSIFIER_COMMANDS,
    add_bench_parser,
    add_route,
    add_serve,
    add_worker,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark-router", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except DSparkRouterError as exc:
        print(json.dumps(exc.to_openai()), file=sys.stderr)
        return 2

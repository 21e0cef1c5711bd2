"""The ``dspark-router`` console command: one entry point, a subcommand per job."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from backends.errors import DSparkRouterError

Handler = Callable[[argparse.Namespace], int]


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate a completion with a local model")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--model", required=True, help="path to a Hugging Face model directory")
    p.add_argument("--backend", choices=["ar", "dspark"], default="ar", help="decoding backend (default: ar)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable, at most 4)")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--json", action="store_true", help="print one JSON object with the whole result")
    p.set_defaults(handler=_generate)


def _generate(args: argparse.Namespace) -> int:
    from backends.autoregressive import AutoregressiveBackend
    from backends.types import GenerationRequest

    fields = {"messages": [{"role": "user", "content": args.prompt}]} if args.chat else {"prompt": args.prompt}
    request = GenerationRequest(
        **fields,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
    )
    backend = AutoregressiveBackend.from_pretrained(args.model, device=args.device, dtype=args.dtype)
    if args.json:
        print(backend.complete(request).model_dump_json())
        return 0
    for chunk in backend.stream(request):
        sys.stdout.write(chunk.delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_generate]


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

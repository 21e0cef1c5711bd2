"""``dspark-router route``: ask the router where a request would go, or run it and show the routed result.

The dry run needs no model on disk, so it is also the quickest way to check a config's rules against a request.
``--request`` takes the body the gateway's ``POST /v1/chat/completions`` takes: inline JSON, a file, or ``-`` for
standard input (a body with a schema or tools does not belong on a command line).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from backends.errors import InvalidRequestError
from router.request import parse_body


def add_route(p: argparse.ArgumentParser) -> None:
    p.add_argument("message", nargs="?", help="a user message, appended to --request's messages if both are given")
    p.add_argument(
        "--request",
        help="a chat-completions body (messages, tools, response_format, metadata...): JSON, a JSON file or - (stdin)",
    )
    p.add_argument("--config", help="router YAML (default: the embedded two-pool config on the default model)")
    p.add_argument("--generate", action="store_true", help="generate and print the routed result")
    p.add_argument("--max-tokens", type=int, default=None)
    p.set_defaults(handler=_route)


def _route(args: argparse.Namespace) -> int:
    from router.sdk import Router

    body = _request_body(args.request) if args.request else {}
    body.pop("stream", None)  # the whole result is printed either way
    if args.message:
        body["messages"] = [*body.get("messages", []), {"role": "user", "content": args.message}]
    if args.max_tokens is not None:
        body["max_tokens"] = args.max_tokens
    with Router.from_config(args.config, check_paths=args.generate) as router:
        outcome = router.complete(**body) if args.generate else router.route(**body)
        print(outcome.model_dump_json(indent=2))
    return 0


def _request_body(value: str) -> dict[str, Any]:
    """Inline JSON when it opens like an object, ``-`` for standard input, else the path of a JSON file."""
    if value == "-":
        return parse_body(sys.stdin.read(), source="the body on standard input", param="request")
    if value.lstrip().startswith("{"):
        return parse_body(value, source="--request", param="request")
    try:
        text = Path(value).read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidRequestError(
            f"--request is neither a JSON object nor a readable file: {exc.strerror or exc}", param="request"
        ) from None
    return parse_body(text, source=f"--request file {value}", param="request")

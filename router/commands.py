"""``dspark-router route``: ask the router where a request would go, or run it and show the routed result.

The dry run needs no model on disk, so it is also the quickest way to check a config's rules against a request.
"""

from __future__ import annotations

import argparse
import json

from backends.errors import InvalidRequestError


def add_route(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("route", help="show the routing decision for a request (or, with --generate, run it)")
    p.add_argument("message", nargs="?", help="a user message, appended to --request's messages if both are given")
    p.add_argument("--request", help="a chat-completions body as JSON (messages, tools, response_format, metadata...)")
    p.add_argument("--config", help="router YAML (default: the embedded two-pool config on models/dspark-mini)")
    p.add_argument("--generate", action="store_true", help="generate and print the routed result")
    p.add_argument("--max-tokens", type=int, default=None)
    p.set_defaults(handler=_route)


def _route(args: argparse.Namespace) -> int:
    from router.sdk import Router

    try:
        body = json.loads(args.request) if args.request else {}
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"--request is not valid JSON: {exc}", param="request") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("--request must be a JSON object", param="request")
    if args.message:
        body["messages"] = [*body.get("messages", []), {"role": "user", "content": args.message}]
    if args.max_tokens is not None:
        body["max_tokens"] = args.max_tokens
    with Router.from_config(args.config, check_paths=args.generate) as router:
        outcome = router.complete(**body) if args.generate else router.route(**body)
        print(outcome.model_dump_json(indent=2))
    return 0

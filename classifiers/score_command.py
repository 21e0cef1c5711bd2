"""``dspark-router score``: the determinism classifier's score of one subtask, alone.

``dspark-router route`` (router/commands.py) shows the whole decision, rules and threshold included. Registered in
``router/cli.py``; only the classifier's own libraries load, not torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from backends.errors import InvalidRequestError
from classifiers import DEFAULT_CLASSIFIER


def add_score(p: argparse.ArgumentParser) -> None:
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument("prompt", nargs="?", help="the subtask, sent as one user message")
    given.add_argument("--request", help="a chat-completions request body: a JSON file, or - for stdin")
    p.add_argument("--classifier", default=str(DEFAULT_CLASSIFIER), help="classifier file (default: the shipped one)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=_score)


def _read_request(source: str) -> dict:
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")
        request = json.loads(text)
    except (OSError, ValueError) as exc:
        raise InvalidRequestError(f"cannot read a JSON request from {source!r}: {exc}", param="request") from None
    if not isinstance(request, dict):
        raise InvalidRequestError("the request body must be a JSON object", param="request")
    return request


def _score(args: argparse.Namespace) -> int:
    from classifiers import load_scorer

    request = _read_request(args.request) if args.request else {"messages": [{"role": "user", "content": args.prompt}]}
    classifier = load_scorer(args.classifier)
    score = classifier.score(request)
    speedup = classifier.expected_speedup(request) if classifier.predicts_speedup else None
    if args.json:
        print(json.dumps({"score": score, "margin": classifier.margin, "expected_speedup": speedup}))
        return 0
    print(f"{score:.4f}  P(DSpark speedup >= {classifier.margin}x)")
    if speedup is not None:
        print(f"{speedup:.2f}x   expected solo DSpark speedup")
    return 0

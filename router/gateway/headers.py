"""The headers the gateway reads and writes: the request id both sides log, and the decision on every answer.

A client's own ``x-request-id`` is kept when it is a plain token of visible ASCII (at most 128 characters) and
replaced by a fresh one otherwise, so whatever a client sends, the id in logs and headers is safe to print.
"""

from __future__ import annotations

import re
import uuid

from starlette.requests import Request

from router.decisions import Decision

REQUEST_ID = re.compile(r"^[\x21-\x7e]{1,128}$")


def request_id(request: Request) -> str:
    """This request's id, chosen once: the error handlers ask for it too, whether or not an endpoint ran."""
    chosen = getattr(request.state, "request_id", None)
    if chosen is None:
        given = request.headers.get("x-request-id", "")
        chosen = request.state.request_id = given if REQUEST_ID.match(given) else uuid.uuid4().hex
    return chosen


def decision_headers(decision: Decision, rid: str) -> dict[str, str]:
    return {
        "x-request-id": rid,
        "x-dspark-pool": decision.pool,
        "x-dspark-rule": decision.rule,
        "x-dspark-score": "none" if decision.score is None else f"{decision.score:.4f}",
    }

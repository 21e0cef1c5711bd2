"""Every failure as OpenAI's error body, ``{"error": {"message", "type", "param", "code"}}``, with its HTTP status.

The typed errors the SDK raises already know their status, type and param (``backends/errors.py``), so a refused
schema, an unknown model or a full queue reach the client exactly as the SDK reports them. The web framework's
own failures are brought into the same shape: request validation is a 400 (never FastAPI's 422), an unknown path
a 404. Anything else is a bug: a 500 whose body names the request id to look up in the server log, never the
exception or its stack trace.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.responses import Response

from backends.errors import DSparkRouterError, InvalidRequestError
from router.gateway.disconnect import ClientGone
from router.gateway.headers import request_id
from router.gateway.metrics import CLIENT_CLOSED

log = logging.getLogger("uvicorn.error")
RETRY_STATUSES = frozenset({429, 503})


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """The body of every error response (documented in /openapi.json)."""

    error: ErrorDetail


class NotReadyError(DSparkRouterError):
    """The models are still loading (or failed to); /readyz says which."""

    error_type = "service_unavailable"
    status_code = 503
    code = "not_ready"


class PayloadTooLargeError(InvalidRequestError):
    status_code = 413
    code = "payload_too_large"


class AuthenticationError(DSparkRouterError):
    error_type = "invalid_request_error"
    status_code = 401
    code = "invalid_api_key"


class RateLimitError(DSparkRouterError):
    """A key over its requests per minute, or the gateway's wait queue full; retry after ``retry_after_s``."""

    error_type = "rate_limit_error"
    status_code = 429
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ProtocolError(InvalidRequestError):
    """The web framework's own refusals (no such path, wrong method), in the same shape as every other error."""

    def __init__(self, message: str, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.code = {404: "not_found", 405: "method_not_allowed"}.get(status_code)


def error_response(
    error: DSparkRouterError, rid: str, retry_after_s: int, headers: Mapping[str, str] | None = None
) -> Response:
    """``ensure_ascii`` JSON: an error may quote the client's input, and that must not break the response."""
    out = {**(headers or {}), "x-request-id": rid}
    if error.status_code in RETRY_STATUSES:
        out["retry-after"] = str(getattr(error, "retry_after_s", None) or retry_after_s)
    body = json.dumps(error.to_openai())
    return Response(body, status_code=error.status_code, headers=out, media_type="application/json")


def install(app: FastAPI, retry_after_s: int) -> None:
    """The handlers for every exception a request can end in."""

    async def typed(request: Request, exc: DSparkRouterError) -> Response:
        if exc.status_code >= 500:
            log.warning("request %s failed: %s: %s", request_id(request), type(exc).__name__, exc.message)
        return error_response(exc, request_id(request), retry_after_s)

    async def validation(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(part) for part in first["loc"] if part != "body") or None
        message = f"{param}: {first['msg']}" if param else str(first["msg"])
        return error_response(InvalidRequestError(message, param=param), request_id(request), retry_after_s)

    async def http(request: Request, exc: HTTPException) -> Response:
        return error_response(
            ProtocolError(str(exc.detail), exc.status_code), request_id(request), retry_after_s, exc.headers
        )

    async def bug(request: Request, exc: Exception) -> Response:
        rid = request_id(request)
        log.error("request %s failed with an unexpected %s (traceback below)", rid, type(exc).__name__)
        error = DSparkRouterError(f"internal error; the server log has the details under request id {rid}")
        return error_response(error, rid, retry_after_s)

    async def gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=int(CLIENT_CLOSED))  # nobody reads it; the status is for the metrics

    app.add_exception_handler(ClientGone, gone)
    app.add_exception_handler(DSparkRouterError, typed)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(HTTPException, http)
    app.add_exception_handler(Exception, bug)

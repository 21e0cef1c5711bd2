"""Typed errors shared by every backend, the router and the gateway.

Each error carries an OpenAI-style ``type`` and, where one field of the request is at fault, its ``param``,
so the gateway can turn any of them into an OpenAI-shaped error body without guessing.
"""

from __future__ import annotations


class DSparkRouterError(Exception):
    """Base of every error this project raises on purpose.

    ``code`` is OpenAI's machine-readable ``error.code`` (``model_not_found``, ...): clients branch on it where the
    message is for people, so only errors a client can act on by kind set one.
    """

    error_type = "server_error"
    status_code = 500
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def to_openai(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


class InvalidRequestError(DSparkRouterError, ValueError):
    """The request itself is wrong; ``param`` names the offending field."""

    error_type = "invalid_request_error"
    status_code = 400


class UnsupportedFormatError(InvalidRequestError):
    """A response_format, schema or grammar that cannot be compiled: refused before any decoding."""


class ModelLoadError(DSparkRouterError):
    """A model path that does not exist, holds no model, or lacks what a backend needs (DSpark heads)."""

    error_type = "model_load_error"


class BackendError(DSparkRouterError):
    """A backend failed while serving a request that was valid."""

    error_type = "backend_error"
    status_code = 502


class QueueFullError(DSparkRouterError):
    """Every place the request may go to is full (a pool's queue, a batch's waiting line); retry later."""

    error_type = "queue_full_error"
    status_code = 429
    code = "queue_full"

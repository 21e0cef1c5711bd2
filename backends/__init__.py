"""Decoding backends of dspark-router: the shared request/result types, the protocol, and the local backends.

Types, errors and the protocol import eagerly (pydantic only); the torch backends load on first use, so a
process that only validates requests or reads a config never pays for torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from backends.errors import BackendError, DSparkRouterError, InvalidRequestError, ModelLoadError, UnsupportedFormatError
from backends.protocol import Backend
from backends.types import (
    ChatMessage,
    GenerationRequest,
    GenerationResult,
    GenerationStats,
    SpanStats,
    StreamChunk,
    Usage,
)

if TYPE_CHECKING:
    from backends.autoregressive import AutoregressiveBackend

__all__ = [
    "AutoregressiveBackend",
    "Backend",
    "BackendError",
    "ChatMessage",
    "DSparkRouterError",
    "GenerationRequest",
    "GenerationResult",
    "GenerationStats",
    "InvalidRequestError",
    "ModelLoadError",
    "SpanStats",
    "StreamChunk",
    "UnsupportedFormatError",
    "Usage",
]


def __getattr__(name: str) -> Any:
    if name == "AutoregressiveBackend":
        return importlib.import_module("backends.autoregressive").AutoregressiveBackend
    raise AttributeError(f"module 'backends' has no attribute {name!r}")

"""Decoding backends of dspark-router: the shared request/result types, the protocol, and the local backends."""

from backends.autoregressive import AutoregressiveBackend
from backends.errors import (
    BackendError,
    DSparkRouterError,
    InvalidRequestError,
    ModelLoadError,
    UnsupportedFormatError,
)
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

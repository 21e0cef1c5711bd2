"""Grammar-constrained decoding shared by every backend: JSON schemas, regexes, Lark grammars and tool calls.

The names below load on first use: the matcher (``engine``) needs torch, and the request-side modules (formats,
schemas, tools) are read by processes that never decode (the classifier's features, a router in front of workers).
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "ConstraintError": "backends.constraints.engine",
    "GrammarConstraint": "backends.constraints.engine",
    "request_grammar": "backends.constraints.formats",
    "cut_tool_call": "backends.constraints.tools",
    "parse_tool_calls": "backends.constraints.tools",
    "resolve_tool_choice": "backends.constraints.tools",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'backends.constraints' has no attribute {name!r}")

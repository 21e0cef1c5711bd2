"""dspark-router: send each agent subtask to the DSpark pool or the standard pool, and learn from the outcome.

``from router import Router`` is the SDK. The import is lazy, so ``import router`` (the CLI, a config check)
does not load torch until a router is actually built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from router.decisions import Decision, RoutedChunk, RoutedResult
    from router.sdk import Router

__all__ = ["Decision", "RoutedChunk", "RoutedResult", "Router"]

_EXPORTS = {
    "Router": "router.sdk",
    "Decision": "router.decisions",
    "RoutedChunk": "router.decisions",
    "RoutedResult": "router.decisions",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'router' has no attribute {name!r}")

"""DSpark: a drafter on a causal LM, confidence-scheduled proposals, verification in the target's pass.

Two drafters: span heads (``heads``) and the published DSpark drafter (``dspark``: parallel backbone over the
target's features, Markov and confidence heads, Algorithm 1 scheduling, DeepSpec's checkpoint layout).

The names below load on first use: the batching engine needs the scheduler without the backend that is
built on the engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from backends.dspark.backend import DSparkBackend
    from backends.dspark.drafter import DSparkDrafter
    from backends.dspark.drafter_config import DrafterConfig
    from backends.dspark.heads import DSparkConfig, SpanHeads
    from backends.dspark.model import DSparkModel
    from backends.dspark.scheduler import SpsCurve, VerifySchedule
    from backends.dspark.selection import SpanPolicy

_HOMES = {
    "DSparkBackend": "backend",
    "DSparkDrafter": "drafter",
    "DrafterConfig": "drafter_config",
    "DSparkConfig": "heads",
    "SpanHeads": "heads",
    "DSparkModel": "model",
    "SpsCurve": "scheduler",
    "VerifySchedule": "scheduler",
    "SpanPolicy": "selection",
}

__all__ = [
    "DSparkBackend",
    "DSparkConfig",
    "DSparkDrafter",
    "DSparkModel",
    "DrafterConfig",
    "SpanHeads",
    "SpanPolicy",
    "SpsCurve",
    "VerifySchedule",
]


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(f"backends.dspark.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'backends.dspark' has no attribute {name!r}")

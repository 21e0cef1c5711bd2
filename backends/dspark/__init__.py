"""DSpark: a drafter on a causal LM, confidence-scheduled proposals, verification in the target's pass.

Two drafters: span heads (``heads``) and the published DSpark drafter (``dspark``: parallel backbone over the
target's features, Markov and confidence heads, Algorithm 1 scheduling, DeepSpec's checkpoint layout). Both
loops verify through :mod:`backends.dspark.verify`; the verification schedule they share with the batching
engine lives below them, in :mod:`backends.scheduling`.
"""

from __future__ import annotations

from backends.dspark.backend import DSparkBackend
from backends.dspark.drafter import DSparkDrafter
from backends.dspark.drafter_config import DrafterConfig
from backends.dspark.heads import DSparkConfig, SpanHeads
from backends.dspark.model import DSparkModel
from backends.dspark.selection import SpanPolicy
from backends.scheduling import SpsCurve, VerifySchedule

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

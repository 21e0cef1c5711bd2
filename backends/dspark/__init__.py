"""DSpark: a drafter on a causal LM, confidence-scheduled proposals, verification in the target's pass.

Two drafters: span heads (``heads``) and the published DSpark drafter (``dspark``: parallel backbone over the
target's features, Markov and confidence heads, Algorithm 1 scheduling, DeepSpec's checkpoint layout)."""

from backends.dspark.backend import DSparkBackend
from backends.dspark.drafter import DSparkDrafter
from backends.dspark.drafter_config import DrafterConfig
from backends.dspark.heads import DSparkConfig, SpanHeads
from backends.dspark.model import DSparkModel
from backends.dspark.scheduler import SpsCurve, VerifySchedule
from backends.dspark.selection import SpanPolicy

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

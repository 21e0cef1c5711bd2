"""DSpark: span heads on a causal LM, confidence-driven span proposals, verification in the same pass."""

from backends.dspark.backend import DSparkBackend
from backends.dspark.heads import DSparkConfig, SpanHeads
from backends.dspark.model import DSparkModel
from backends.dspark.selection import SpanPolicy

__all__ = ["DSparkBackend", "DSparkConfig", "DSparkModel", "SpanHeads", "SpanPolicy"]

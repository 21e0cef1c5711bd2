"""Determinism classifiers: score how much a subtask would gain from the DSpark pool."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from classifiers.model import DeterminismClassifier

DATA_DIR = Path(__file__).parent / "data"
DEFAULT_CLASSIFIER = DATA_DIR / "default.skops"
DEFAULT_MEASUREMENTS = DATA_DIR / "measurements.jsonl"
# The speedup that makes DSpark worth it: below it, a small gain does not pay for a wrong guess.
DEFAULT_MARGIN = 1.15
# The score to route at when a classifier carries no calibrated threshold (classifiers/gain.py chooses one).
DEFAULT_THRESHOLD = 0.5


@runtime_checkable
class Scorer(Protocol):
    """What the router's policy needs from a classifier: a calibrated probability in [0, 1] that DSpark on
    this chat-completions request beats the standard pool by the policy's margin.

    A scorer may also carry ``threshold``, the score from which routing to DSpark saves time; the policy routes
    at it unless the config sets its own threshold (:class:`~classifiers.model.DeterminismClassifier` has one)."""

    def score(self, request: dict[str, Any]) -> float: ...


def load_default() -> DeterminismClassifier:
    """The shipped classifier (``classifiers/data/default.skops``, trained by ``dspark-router calibrate``).
    Imported lazily: the router imports :class:`Scorer` without paying for scikit-learn."""
    from classifiers.model import DeterminismClassifier

    return DeterminismClassifier.load(DEFAULT_CLASSIFIER)

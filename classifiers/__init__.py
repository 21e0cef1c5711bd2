"""Determinism classifiers: score how much a subtask would gain from the DSpark pool, and predict by how much."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

# Hand-written agent requests the corpus generator never wrote: a request mix the classifier was not fitted on (and
# the drafters never trained on); defined beside the filter that keeps it out of their corpus.
from backends.corpus.evaluation import AGENT_MIX as AGENT_MIX

if TYPE_CHECKING:
    from classifiers.model import DeterminismClassifier
    from classifiers.weights import ClassifierWeights

DATA_DIR = Path(__file__).parent / "data"
DEFAULT_CLASSIFIER = DATA_DIR / "default.skops"
DEFAULT_MEASUREMENTS = DATA_DIR / "measurements.jsonl"
DEFAULT_RETEST = DATA_DIR / "retest.jsonl"
"""A seeded sample of the corpus measured a second time (``calibrate --sample``): how repeatable a label is."""
DEFAULT_CARRY_OVER = DATA_DIR / "carry_over.jsonl"
"""The same sample measured on a machine other than the labels': how well speedups carry from one to another."""
DEFAULT_AGENT_MIX_MEASUREMENTS = DATA_DIR / "agent_mix_measurements.jsonl"
""":data:`AGENT_MIX` measured on one machine: the live traffic ``bench route`` replays to show retraining."""
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


@runtime_checkable
class SpeedupScorer(Protocol):
    """What ``policy.objective: time_saved`` needs of a scorer beyond its score: DSpark's expected solo speedup on
    a request (standard time over DSpark time, 1.0 for no gain), which the policy weighs against each pool's load.

    ``predicts_speedup`` says whether this scorer has a model for it: a classifier file written before the
    expected-gain model existed scores, but cannot predict speedups. A scorer may also carry
    ``calibration_curve`` (a :class:`~backends.scheduling.SpsCurve`, or None): the cost curve of the
    machine its speedups were measured on, which the policy carries over to the machine it routes on."""

    predicts_speedup: bool

    def expected_speedup(self, request: dict[str, Any]) -> float: ...


def load_scorer(path: str | Path) -> ClassifierWeights | DeterminismClassifier:
    """What the router scores with from a classifier file: the weights saved beside it for it
    (:mod:`classifiers.weights`, no skops to import), else the archive itself. Imported lazily: the router imports
    :class:`Scorer` without paying for scikit-learn."""
    from classifiers.weights import ClassifierWeights

    weights = ClassifierWeights.of_archive(Path(path))
    if weights is not None:
        return weights
    from classifiers.model import DeterminismClassifier

    return DeterminismClassifier.load(path)


def load_default() -> ClassifierWeights | DeterminismClassifier:
    """The shipped classifier (``classifiers/data/default.skops``, trained by ``dspark-router calibrate``)."""
    return load_scorer(DEFAULT_CLASSIFIER)

"""The determinism classifier: a fitted scikit-learn Pipeline, its margin, the expected-gain model beside it, and
lean one-request paths for both.

The expected-gain model is a ridge regression of log speedup over the same features (the classifier's fitted
vectorizer), so one file holds both and the router's ``time_saved`` objective costs one more sparse dot. Files
from before it existed load without it (``predicts_speedup`` is False); a ``gain`` entry of another type is
refused as malformed.

Files are skops archives, never pickles: loading one runs no code from the file, only rebuilds the types listed
in :data:`TRUSTED_TYPES` (scikit-learn's own are trusted by skops already). Anything else, a file that is not a
skops archive, or a skops archive holding something other than a classifier this module wrote, is refused with
:class:`ClassifierLoadError` before it can be used.
"""

from __future__ import annotations

import math
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import skops.io as sio
from sklearn.linear_model import LogisticRegression, Ridge
from sklearn.pipeline import Pipeline

from backends.errors import ModelLoadError
from backends.scheduling import SpsCurve
from classifiers import DEFAULT_THRESHOLD
from classifiers.features import RequestVectorizer

FORMAT = "dspark-router/determinism-classifier"
FORMAT_VERSION = 3
TRUSTED_TYPES = ["classifiers.features.RequestVectorizer"]


class ClassifierLoadError(ModelLoadError):
    """A classifier file that is missing, not a skops archive, holds untrusted types, or holds something else."""


def _sigmoid(z: float) -> float:
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


class DeterminismClassifier:
    """P(DSpark's speedup on a request >= ``margin``), from [RequestVectorizer -> LogisticRegression].

    The logistic regression's C is chosen on subtasks of templates it was not fitted on, by log loss (see
    :mod:`classifiers.train`), so its probabilities are calibrated for new kinds of subtask, not just seen ones.
    ``score`` skips the Pipeline: one sparse row dotted with the coefficients, tens of µs instead of the
    Pipeline's per-call validation; ``score_many`` goes through the Pipeline and gives the same numbers.
    ``expected_speedup`` does the same with the expected-gain model's coefficients (see :mod:`classifiers.train`).
    """

    def __init__(
        self, pipeline: Pipeline, margin: float, info: dict[str, Any] | None = None, gain: Ridge | None = None
    ) -> None:
        vectorizer, model = (step for _, step in pipeline.steps)
        if not isinstance(vectorizer, RequestVectorizer) or not isinstance(model, LogisticRegression):
            raise TypeError("the pipeline must be [RequestVectorizer, LogisticRegression]")
        if list(model.classes_) != [False, True] or model.coef_.shape != (1, vectorizer.n_features):
            raise ValueError("the logistic regression must be fitted on boolean labels over the vectorizer's columns")
        if gain is not None and (not isinstance(gain, Ridge) or np.shape(gain.coef_) != (vectorizer.n_features,)):
            raise ValueError("the expected-gain model must be a ridge regression over the vectorizer's columns")
        self.pipeline = pipeline
        self.margin = float(margin)
        self.info = dict(info or {})
        self.gain = gain
        self._vectorizer = vectorizer
        self._coef = np.ascontiguousarray(model.coef_[0], dtype=np.float64)
        self._intercept = float(model.intercept_[0])
        if gain is not None:
            self._gain_coef = np.ascontiguousarray(gain.coef_, dtype=np.float64)
            self._gain_intercept = float(gain.intercept_)

    @property
    def threshold(self) -> float:
        """The score from which routing to DSpark saves time, chosen when the classifier was trained (see
        :mod:`classifiers.gain`); files from before it was stored route at the plain 0.5."""
        return float(self.info.get("route_threshold", DEFAULT_THRESHOLD))

    def score(self, request: dict[str, Any]) -> float:
        indices, values = self._vectorizer.row(request)
        return _sigmoid(float(self._coef[indices] @ values) + self._intercept)

    def score_many(self, requests: Iterable[dict[str, Any]]) -> np.ndarray:
        return self.pipeline.predict_proba(list(requests))[:, 1]

    @property
    def predicts_speedup(self) -> bool:
        return self.gain is not None

    @property
    def calibration_curve(self) -> SpsCurve | None:
        """The target's steps per second by forward length on the machine the speedups were measured on
        (``calibrate --model`` stores it); None for a classifier retrained from a log, taken as measured here."""
        profile = self.info.get("calibration_profile")
        return SpsCurve.from_stored(profile["steps_per_s"]) if isinstance(profile, dict) else None

    def expected_speedup(self, request: dict[str, Any]) -> float:
        """DSpark's expected solo speedup on the request: exp of the predicted log speedup, by the same lean path
        as ``score``."""
        self._gain_model()
        indices, values = self._vectorizer.row(request)
        return math.exp(float(self._gain_coef[indices] @ values) + self._gain_intercept)

    def expected_speedup_many(self, requests: Iterable[dict[str, Any]]) -> np.ndarray:
        return np.exp(self._gain_model().predict(self._vectorizer.transform(list(requests))))

    def _gain_model(self) -> Ridge:
        if self.gain is None:
            raise ClassifierLoadError(
                "this classifier file has no expected-gain model: retrain it with dspark-router calibrate",
                param="classifier",
            )
        return self.gain

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "margin": self.margin,
            "info": self.info,
            "pipeline": self.pipeline,
            "gain": self.gain,
        }
        # Almost every hashed column is never seen in training, so the coefficients compress ~10x.
        sio.dump(state, path, compression=zipfile.ZIP_DEFLATED)
        return path

    @classmethod
    def load(cls, path: str | Path) -> DeterminismClassifier:
        path = Path(path)
        if not path.is_file():
            raise ClassifierLoadError(
                f"no classifier file at {str(path)!r} (train one with: dspark-router calibrate --model DSPARK_MODEL)",
                param="classifier",
            )
        # A file we did not write can fail to parse in any number of ways; each one means the same: refuse it.
        try:
            untrusted = sio.get_untrusted_types(file=path)
        except Exception as exc:
            raise ClassifierLoadError(
                f"{str(path)!r} is not a skops classifier file ({type(exc).__name__}: {exc})", param="classifier"
            ) from None
        foreign = sorted(set(untrusted) - set(TRUSTED_TYPES))
        if foreign:
            raise ClassifierLoadError(
                f"{str(path)!r} holds types this project does not trust: {', '.join(foreign)}", param="classifier"
            )
        try:
            state = sio.load(path, trusted=TRUSTED_TYPES)
        except Exception as exc:
            raise ClassifierLoadError(
                f"cannot load {str(path)!r} ({type(exc).__name__}: {exc})", param="classifier"
            ) from None
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise ClassifierLoadError(
                f"{str(path)!r} is a skops file but not a determinism classifier ({type(state).__name__})",
                param="classifier",
            )
        if state.get("version") != FORMAT_VERSION:
            raise ClassifierLoadError(
                f"{str(path)!r} has classifier format version {state.get('version')!r}; this code reads "
                f"{FORMAT_VERSION}: retrain it with dspark-router calibrate",
                param="classifier",
            )
        try:
            return cls(state["pipeline"], state["margin"], state.get("info"), state.get("gain"))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ClassifierLoadError(
                f"{str(path)!r} holds a malformed classifier: {exc}", param="classifier"
            ) from None

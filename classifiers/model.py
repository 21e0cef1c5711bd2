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

import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import skops.io as sio
from sklearn.linear_model import LogisticRegression, Ridge
from sklearn.pipeline import Pipeline

from backends.scheduling import SpsCurve
from classifiers.features import RequestVectorizer
from classifiers.weights import ClassifierLoadError, ClassifierWeights, file_sha256, weights_path

FORMAT = "dspark-router/determinism-classifier"
FORMAT_VERSION = 3
TRUSTED_TYPES = ["classifiers.features.RequestVectorizer"]


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
        self.weights = ClassifierWeights(
            rows=vectorizer.rows,
            coef=np.ascontiguousarray(model.coef_[0], dtype=np.float64),
            intercept=float(model.intercept_[0]),
            margin=self.margin,
            info=self.info,
            gain_coef=None if gain is None else np.ascontiguousarray(gain.coef_, dtype=np.float64),
            gain_intercept=0.0 if gain is None else float(gain.intercept_),
        )
        """The one-request paths (:mod:`classifiers.weights`), which the router loads without this archive."""

    @property
    def threshold(self) -> float:
        return self.weights.threshold

    @property
    def predicts_speedup(self) -> bool:
        return self.weights.predicts_speedup

    @property
    def calibration_curve(self) -> SpsCurve | None:
        return self.weights.calibration_curve

    def score(self, request: dict[str, Any]) -> float:
        return self.weights.score(request)

    def expected_speedup(self, request: dict[str, Any]) -> float:
        return self.weights.expected_speedup(request)

    def score_many(self, requests: Iterable[dict[str, Any]]) -> np.ndarray:
        return self.pipeline.predict_proba(list(requests))[:, 1]

    def expected_speedup_many(self, requests: Iterable[dict[str, Any]]) -> np.ndarray:
        return np.exp(self._gain_model().predict(self.weights.rows.matrix(list(requests))))

    def _gain_model(self) -> Ridge:
        self.weights.require_gain()
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
        self.weights.save(weights_path(path), file_sha256(path))
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

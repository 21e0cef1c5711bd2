"""What the router scores a request with: the classifier's coefficients over the request's features, without the
scikit-learn objects around them.

A classifier file (``*.skops``) holds the fitted Pipeline and the expected-gain Ridge, which training, ``bench
route`` and ``score_many`` need. Scoring one request needs only the vectorizer's parameters, two coefficient
vectors and their intercepts, so :meth:`DeterminismClassifier.save <classifiers.model.DeterminismClassifier.save>`
writes them beside it as ``*.weights.npz`` (numpy arrays and one JSON string, read without pickle). The router reads
that when it is the file's own (it names the archive's sha256): loading skops costs 4-5 seconds on 2 cores (it
imports every scikit-learn estimator to know which types it trusts), which ``dspark-router route`` paid on every
call. Anything else (no weights file, an older or a foreign one) loads the archive instead.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from backends.errors import ModelLoadError
from backends.scheduling import SpsCurve
from classifiers import DEFAULT_THRESHOLD
from classifiers.request_rows import RequestRows

WEIGHTS_FORMAT = "dspark-router/classifier-weights"
WEIGHTS_VERSION = 1
WEIGHTS_SUFFIX = ".weights.npz"


class ClassifierLoadError(ModelLoadError):
    """A classifier file that is missing, not a skops archive, holds untrusted types, or holds something else."""


def _sigmoid(z: float) -> float:
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


def weights_path(archive: Path) -> Path:
    """Where the weights of the classifier archive ``archive`` are kept."""
    return archive.with_name(archive.stem + WEIGHTS_SUFFIX)


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass(frozen=True)
class ClassifierWeights:
    """P(DSpark's speedup >= ``margin``) as the logistic regression's sigmoid of one sparse row dotted with its
    coefficients, and the expected speedup as exp of the Ridge's: tens of microseconds a request, the same numbers as
    the Pipeline's ``predict_proba`` and ``predict``."""

    rows: RequestRows
    coef: np.ndarray
    intercept: float
    margin: float
    info: dict[str, Any] = field(default_factory=dict)
    gain_coef: np.ndarray | None = None
    gain_intercept: float = 0.0

    @property
    def predicts_speedup(self) -> bool:
        return self.gain_coef is not None

    @property
    def threshold(self) -> float:
        """The score from which routing to DSpark saves time, chosen when the classifier was trained (see
        :mod:`classifiers.gain`); files from before it was stored route at the plain 0.5."""
        return float(self.info.get("route_threshold", DEFAULT_THRESHOLD))

    @property
    def calibration_curve(self) -> SpsCurve | None:
        """The target's steps per second by forward length on the machine the speedups were measured on
        (``calibrate --model`` stores it); None for a classifier retrained from a log, taken as measured here."""
        profile = self.info.get("calibration_profile")
        return SpsCurve.from_stored(profile["steps_per_s"]) if isinstance(profile, dict) else None

    def score(self, request: dict[str, Any]) -> float:
        indices, values = self.rows.row(request)
        return _sigmoid(float(self.coef[indices] @ values) + self.intercept)

    def expected_speedup(self, request: dict[str, Any]) -> float:
        """DSpark's expected solo speedup on the request."""
        self.require_gain()
        indices, values = self.rows.row(request)
        return math.exp(float(self.gain_coef[indices] @ values) + self.gain_intercept)

    def score_many(self, requests: Iterable[dict[str, Any]]) -> np.ndarray:
        """:meth:`score` of each request, from one sparse matrix."""
        logits = self.rows.matrix(list(requests)) @ self.coef + self.intercept
        return 1.0 / (1.0 + np.exp(-logits))

    def expected_speedup_many(self, requests: Iterable[dict[str, Any]]) -> np.ndarray:
        """:meth:`expected_speedup` of each request, from one sparse matrix."""
        self.require_gain()
        return np.exp(self.rows.matrix(list(requests)) @ self.gain_coef + self.gain_intercept)

    def require_gain(self) -> None:
        if self.gain_coef is None:
            raise ClassifierLoadError(
                "this classifier file has no expected-gain model: retrain it with dspark-router calibrate",
                param="classifier",
            )

    def save(self, path: Path, archive_sha256: str) -> Path:
        """Write these weights as the ones of the archive whose sha256 is ``archive_sha256``."""
        meta = {
            "format": WEIGHTS_FORMAT,
            "version": WEIGHTS_VERSION,
            "archive_sha256": archive_sha256,
            "margin": self.margin,
            "info": self.info,
            "vectorizer": dataclasses.asdict(self.rows),
            "intercept": self.intercept,
            "gain_intercept": self.gain_intercept if self.gain_coef is not None else None,
        }
        arrays = {"meta": np.array(json.dumps(meta)), "coef": self.coef}
        if self.gain_coef is not None:
            arrays["gain_coef"] = self.gain_coef
        with path.open("wb") as out:
            np.savez_compressed(out, **arrays)
        return path

    @classmethod
    def of_archive(cls, archive: Path) -> ClassifierWeights | None:
        """The weights written beside ``archive`` for it, or None where there are none, or they are another
        archive's, another format's or unreadable (the caller loads the archive itself)."""
        path = weights_path(archive)
        if not path.is_file():
            return None
        try:
            with np.load(path, allow_pickle=False) as stored:
                meta = json.loads(str(stored["meta"]))
                coef = np.ascontiguousarray(stored["coef"], dtype=np.float64)
                gain_coef = stored["gain_coef"].astype(np.float64) if "gain_coef" in stored.files else None
            if (meta.get("format"), meta.get("version")) != (WEIGHTS_FORMAT, WEIGHTS_VERSION):
                return None
            if meta["archive_sha256"] != file_sha256(archive):
                return None
            rows = RequestRows(**{**meta["vectorizer"], "word_ngrams": tuple(meta["vectorizer"]["word_ngrams"])})
            if coef.shape != (rows.n_features,) or (gain_coef is not None and gain_coef.shape != (rows.n_features,)):
                return None
            return cls(
                rows=rows,
                coef=coef,
                intercept=float(meta["intercept"]),
                margin=float(meta["margin"]),
                info=dict(meta.get("info") or {}),
                gain_coef=gain_coef,
                gain_intercept=float(meta["gain_intercept"] or 0.0),
            )
        except (OSError, ValueError, KeyError, TypeError):  # unreadable: the archive is the classifier
            return None

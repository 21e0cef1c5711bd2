"""Fit the determinism classifier on measured subtasks: label = speedup >= margin.

The logistic regression is fitted on the train split for each C of a small grid; the C whose probabilities have
the lowest log loss on the validation split (templates the fit never saw) wins, and the final model is refitted
on train and validation together. Choosing C by held-out log loss is what calibrates the probabilities: too
little regularisation makes a hashed-n-gram model overconfident on new templates, too much flattens it.

The score the router should route at is chosen here too (:mod:`classifiers.gain`): train and validation are
split into template-grouped folds, each fold is scored by a model fitted on the others, and the threshold that
saves the most time over those out-of-fold scores is stored with the classifier. Scores of fitted subtasks would
be too confident to choose it from.
The expected-gain model beside it (what ``policy.objective: time_saved`` routes by) is a ridge regression of log
speedup on the same features, its alpha chosen the same way, by squared error on the validation templates, then
refitted on train and validation. Log, because speedups are ratios: 2x and 0.5x are equally far from even.
The test split is never touched here; ``dspark-router bench route`` reports on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import scipy.sparse as sp
from sklearn.linear_model import LogisticRegression, Ridge
from sklearn.metrics import log_loss, mean_squared_error
from sklearn.model_selection import GroupKFold
from sklearn.pipeline import Pipeline
from threadpoolctl import threadpool_limits

from backends.errors import DSparkRouterError
from classifiers import DEFAULT_MARGIN, DEFAULT_THRESHOLD
from classifiers.features import RequestVectorizer
from classifiers.gain import best_threshold, time_saved
from classifiers.model import DeterminismClassifier
from classifiers.records import Measurement

C_GRID = (0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0)
DEFAULT_C = 1.0
ALPHA_GRID = (0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)
DEFAULT_ALPHA = 1.0
THRESHOLD_FOLDS = 5


class TrainingError(DSparkRouterError, ValueError):
    """Measurements that cannot train a classifier, e.g. a train split whose labels are all the same."""

    error_type = "invalid_request_error"
    status_code = 400


def _logistic(c: float) -> LogisticRegression:
    return LogisticRegression(C=c, max_iter=5000)


def train(
    records: Sequence[Measurement], margin: float = DEFAULT_MARGIN, calibration_profile: dict[str, Any] | None = None
) -> DeterminismClassifier:
    """``calibration_profile``: ``{"machine": key, "steps_per_s": {tokens: rate}}`` of the machine the records were
    measured on, stored for the router to carry the speedups over to its own (see ``router/expected_time.py``)."""
    # The fits are small: BLAS threads only add synchronisation, and thrash where decoding keeps the cores busy
    # (20x slower on two busy cores).
    with threadpool_limits(limits=1):
        classifier = _train(records, margin)
    if calibration_profile is not None:
        classifier.info["calibration_profile"] = calibration_profile
    return classifier


def _train(records: Sequence[Measurement], margin: float) -> DeterminismClassifier:
    measured = [record for record in records if record.speedup is not None]
    train_part = [record for record in measured if record.resolved_split == "train"]
    val_part = [record for record in measured if record.resolved_split == "val"]
    if not train_part:
        raise TrainingError(
            f"no measured train-split record among {len(records)} ({len(records) - len(measured)} have no speedup): "
            "nothing to train on",
            param="from_log",
        )
    y_train = np.array([record.speedup >= margin for record in train_part])
    if len(set(y_train.tolist())) < 2:
        side = "at or above" if y_train.any() else "below"
        raise TrainingError(
            f"all {len(train_part)} measured train-split subtasks are {side} the margin {margin}x, so there is "
            "nothing to learn: measure more subtasks, or retrain from the measurements (calibrate --from-log) with "
            "another --margin",
            param="margin",
        )
    y_val = np.array([record.speedup >= margin for record in val_part], dtype=bool)
    vectorizer = RequestVectorizer()
    x_all = vectorizer.transform([record.request for record in train_part + val_part])
    x_train, x_val = x_all[: len(train_part)], x_all[len(train_part) :]
    c, val_log_loss = DEFAULT_C, None
    if val_part:
        losses = {
            candidate: log_loss(
                y_val, _logistic(candidate).fit(x_train, y_train).predict_proba(x_val)[:, 1], labels=[False, True]
            )
            for candidate in C_GRID
        }
        c = min(losses, key=losses.__getitem__)
        val_log_loss = losses[c]
    fitted = train_part + val_part
    y_all = np.concatenate([y_train, y_val])
    model = _logistic(c).fit(x_all, y_all)
    threshold, folds = _route_threshold(x_all, y_all, fitted, c)
    log_speedups = np.log([record.speedup for record in fitted])
    gain, alpha, val_rmse = _fit_gain(x_all, log_speedups, len(train_part))
    info = {
        "C": c,
        "val_log_loss": val_log_loss,
        "gain_alpha": alpha,
        "gain_val_rmse_log": val_rmse,
        "route_threshold": threshold,
        "route_threshold_folds": folds,
        "train_subtasks": len(train_part),
        "val_subtasks": len(val_part),
        "held_out_test_subtasks": sum(record.resolved_split == "test" for record in measured),
        "positive_rate": float(y_all.mean()),
    }
    return DeterminismClassifier(Pipeline([("features", vectorizer), ("classifier", model)]), margin, info, gain)


def _fit_gain(x: sp.csr_matrix, log_speedups: np.ndarray, n_train: int) -> tuple[Ridge, float, float | None]:
    """The expected-gain model refitted on every row, its alpha, and the validation RMSE (in log speedup) that
    chose it; rows from ``n_train`` on are the validation split (none: the default alpha)."""
    alpha, val_rmse = DEFAULT_ALPHA, None
    if n_train < len(log_speedups):
        fit_x, fit_y, val_x, val_y = x[:n_train], log_speedups[:n_train], x[n_train:], log_speedups[n_train:]
        errors = {
            candidate: mean_squared_error(val_y, Ridge(alpha=candidate).fit(fit_x, fit_y).predict(val_x))
            for candidate in ALPHA_GRID
        }
        alpha = min(errors, key=errors.__getitem__)
        val_rmse = float(np.sqrt(errors[alpha]))
    return Ridge(alpha=alpha).fit(x, log_speedups), alpha, val_rmse


def _route_threshold(x: sp.csr_matrix, y: np.ndarray, records: Sequence[Measurement], c: float) -> tuple[float, int]:
    """The threshold that saves the most time over template-grouped out-of-fold scores, and the folds used;
    :data:`~classifiers.DEFAULT_THRESHOLD` where there are fewer than two templates to hold out."""
    groups = [record.group for record in records]
    folds = min(THRESHOLD_FOLDS, len(set(groups)))
    if folds < 2:
        return DEFAULT_THRESHOLD, 0
    scores = np.empty(len(records))
    for fit_rows, held_rows in GroupKFold(folds).split(x, groups=groups):
        # A fold whose fitted part holds one label can only predict that label's rate.
        if len(set(y[fit_rows].tolist())) < 2:
            scores[held_rows] = float(y[fit_rows].mean())
        else:
            scores[held_rows] = _logistic(c).fit(x[fit_rows], y[fit_rows]).predict_proba(x[held_rows])[:, 1]
    return best_threshold(scores, time_saved(records)), folds

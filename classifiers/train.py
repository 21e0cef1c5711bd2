"""Fit the determinism classifier on measured subtasks: label = speedup >= margin.

The logistic regression is fitted on the train split for each C of a small grid; the C whose probabilities have
the lowest log loss on the validation split (templates the fit never saw) wins, and the final model is refitted
on train and validation together. Choosing C by held-out log loss is what calibrates the probabilities: too
little regularisation makes a hashed-n-gram model overconfident on new templates, too much flattens it.
The test split is never touched here; ``dspark-router bench route`` reports on it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import log_loss
from sklearn.pipeline import Pipeline
from threadpoolctl import threadpool_limits

from backends.errors import DSparkRouterError
from classifiers import DEFAULT_MARGIN
from classifiers.features import RequestVectorizer
from classifiers.model import DeterminismClassifier
from classifiers.records import Measurement

C_GRID = (0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0)
DEFAULT_C = 1.0


class TrainingError(DSparkRouterError, ValueError):
    """Measurements that cannot train a classifier, e.g. a train split whose labels are all the same."""

    error_type = "invalid_request_error"
    status_code = 400


def _logistic(c: float) -> LogisticRegression:
    return LogisticRegression(C=c, max_iter=5000)


def train(records: Sequence[Measurement], margin: float = DEFAULT_MARGIN) -> DeterminismClassifier:
    # The fits are small: BLAS threads only add synchronisation, and thrash where decoding keeps the cores busy
    # (20x slower on two busy cores).
    with threadpool_limits(limits=1):
        return _train(records, margin)


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
    model = _logistic(c).fit(x_all, np.concatenate([y_train, y_val]))
    info = {
        "C": c,
        "val_log_loss": val_log_loss,
        "train_subtasks": len(train_part),
        "val_subtasks": len(val_part),
        "held_out_test_subtasks": sum(record.resolved_split == "test" for record in measured),
        "positive_rate": float(np.concatenate([y_train, y_val]).mean()),
    }
    return DeterminismClassifier(Pipeline([("features", vectorizer), ("classifier", model)]), margin, info)

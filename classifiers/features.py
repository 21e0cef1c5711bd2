"""The classifier's first step as a scikit-learn estimator: request dicts to rows (:mod:`classifiers.request_rows`),
in a Pipeline that ``fit``, ``predict_proba`` and a skops archive know. Its class name is stored in every saved
classifier (``classifiers.model.TRUSTED_TYPES``), so it stays here; the rows themselves need no scikit-learn.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import scipy.sparse as sp
from sklearn.base import BaseEstimator, TransformerMixin

from classifiers.request_rows import TEXT_WEIGHT, RequestRows


class RequestVectorizer(TransformerMixin, BaseEstimator):
    """Chat-completions request dicts to sparse rows: [word n-grams | structure features].

    Stateless, so ``fit`` learns nothing; its parameters are the whole of what a saved classifier stores.
    """

    def __init__(
        self, word_features: int = 2**15, word_ngrams: tuple[int, int] = (1, 2), text_weight: float = TEXT_WEIGHT
    ) -> None:
        self.word_features = word_features
        self.word_ngrams = word_ngrams
        self.text_weight = text_weight

    @property
    def n_features(self) -> int:
        return self.rows.n_features

    def fit(self, requests: Sequence[dict[str, Any]], y: Any = None) -> RequestVectorizer:
        return self

    def __sklearn_is_fitted__(self) -> bool:
        return True

    @property
    def rows(self) -> RequestRows:
        return RequestRows(self.word_features, tuple(self.word_ngrams), self.text_weight)

    def row(self, request: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        return self.rows.row(request)

    def transform(self, requests: Sequence[dict[str, Any]]) -> sp.csr_matrix:
        return self.rows.matrix(requests)

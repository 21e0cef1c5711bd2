"""The expected-gain model beside the determinism classifier: fitted by ``train``, one-request predictions equal to
the batch path, saved and loaded with skops in the classifier's file, older and foreign files handled.

Speedups are made up from each subtask's kind, as in test_classifier_model.py.
"""

# ruff: noqa: F811 - the shared fixtures are imported by name and then requested as arguments

from __future__ import annotations

import numpy as np
import pytest
import skops.io as sio
from sklearn.linear_model import LogisticRegression

from classifiers import SpeedupScorer
from classifiers.model import FORMAT, FORMAT_VERSION, ClassifierLoadError, DeterminismClassifier
from classifiers.train import ALPHA_GRID
from router.config import PolicyConfig
from router.errors import ConfigError
from router.policy import Policy
from tests.test_classifier_features import REQUEST_SHAPES
from tests.test_classifier_model import Foreign, classifier, records, saved  # noqa: F401


def test_one_request_predictions_equal_the_batch_path(classifier, records):
    requests = [record.request for record in records] + list(REQUEST_SHAPES.values())
    one_by_one = np.array([classifier.expected_speedup(request) for request in requests])
    assert (one_by_one > 0).all()
    assert np.allclose(one_by_one, classifier.expected_speedup_many(requests), rtol=1e-9)
    assert isinstance(classifier, SpeedupScorer) and classifier.predicts_speedup


def test_held_out_templates_get_the_speedup_of_their_kind(classifier, records):
    test = [record for record in records if record.split == "test"]
    predicted = classifier.expected_speedup_many(record.request for record in test)
    fast = np.array([record.speedup > 1.5 for record in test])
    assert predicted[fast].mean() > 1.25 * predicted[~fast].mean()


def test_training_records_the_regularisation_it_chose(classifier):
    assert classifier.info["gain_alpha"] in ALPHA_GRID
    assert 0.0 < classifier.info["gain_val_rmse_log"] < 0.5


def test_the_gain_model_round_trips_in_the_classifier_file(classifier, saved, records):
    loaded = DeterminismClassifier.load(saved)
    requests = [record.request for record in records[:20]]
    assert np.array_equal(loaded.expected_speedup_many(requests), classifier.expected_speedup_many(requests))
    assert loaded.expected_speedup(requests[0]) == classifier.expected_speedup(requests[0])


def test_a_file_from_before_the_gain_model_scores_but_cannot_route_for_time(classifier, tmp_path):
    path = tmp_path / "older.skops"
    sio.dump({"format": FORMAT, "version": FORMAT_VERSION, "margin": 1.15, "pipeline": classifier.pipeline}, path)
    loaded = DeterminismClassifier.load(path)
    request = REQUEST_SHAPES["user_only"]
    assert not loaded.predicts_speedup and loaded.score(request) == classifier.score(request)
    with pytest.raises(ClassifierLoadError, match="dspark-router calibrate"):
        loaded.expected_speedup(request)
    with pytest.raises(ConfigError) as info:
        Policy(PolicyConfig(objective="time_saved"), loaded, None)
    assert info.value.param == "policy.classifier"


@pytest.mark.parametrize(
    ("gain", "message"),
    [(LogisticRegression(), "malformed classifier"), (Foreign(), r"does not trust: \S*Foreign")],
)
def test_a_foreign_gain_model_is_refused(classifier, tmp_path, gain, message):
    path = tmp_path / "bad.skops"
    state = {"format": FORMAT, "version": FORMAT_VERSION, "margin": 1.15, "pipeline": classifier.pipeline}
    sio.dump({**state, "gain": gain}, path)
    with pytest.raises(ClassifierLoadError, match=message):
        DeterminismClassifier.load(path)

"""The determinism classifier: training, scoring, skops round trips, refusal of files it did not write.

Speedups here are made up from each subtask's kind (a test of the pipeline, never shipped): measured ones come
from ``dspark-router calibrate`` and are tested end to end in test_classifier_calibration.py.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import zipfile

import numpy as np
import pytest
import skops.io as sio
from sklearn.linear_model import LogisticRegression

import classifiers
from backends.corpus.subtasks import generate_subtasks, read_jsonl
from backends.errors import ModelLoadError
from classifiers import Scorer
from classifiers.corpus import CORPUS_PATH, build_corpus, template_splits
from classifiers.gain import THRESHOLD_GRID, best_threshold, time_saved
from classifiers.model import FORMAT, FORMAT_VERSION, ClassifierLoadError, DeterminismClassifier
from classifiers.records import Measurement
from classifiers.train import TrainingError, train
from classifiers.weights import ClassifierWeights, weights_path
from tests.test_classifier_features import REQUEST_SHAPES


def made_up_speedup(kind: str, temperature: float, jitter: float) -> float:
    fast = kind in ("json_extraction", "tool_call_arguments", "code_completion", "code_edit") and temperature == 0
    return (1.8 if fast else 0.9) * jitter


@pytest.fixture(scope="module")
def records() -> list[Measurement]:
    subtasks = generate_subtasks(132, seed=11)
    splits = template_splits(subtasks)
    jitter = np.random.default_rng(0).uniform(0.9, 1.1, len(subtasks))
    return [
        Measurement(
            request=subtask.to_request_dict(),
            speedup=made_up_speedup(subtask.kind, subtask.temperature, j),
            split=splits[subtask.template],
            kind=subtask.kind,
        )
        for subtask, j in zip(subtasks, jitter)
    ]


@pytest.fixture(scope="module")
def classifier(records) -> DeterminismClassifier:
    return train(records)


@pytest.fixture(scope="module")
def saved(classifier, tmp_path_factory):
    return classifier.save(tmp_path_factory.mktemp("classifier") / "c.skops")


def test_scores_are_probabilities_and_match_the_pipeline(classifier, records):
    requests = [record.request for record in records] + list(REQUEST_SHAPES.values())
    one_by_one = np.array([classifier.score(request) for request in requests])
    assert ((one_by_one >= 0) & (one_by_one <= 1)).all()
    assert np.allclose(one_by_one, classifier.score_many(requests), atol=1e-12)
    assert isinstance(classifier, Scorer)


def test_held_out_templates_rank_by_the_learnt_signal(classifier, records):
    test = [record for record in records if record.split == "test"]
    scores = classifier.score_many(record.request for record in test)
    fast = np.array([record.speedup >= classifier.margin for record in test])
    assert scores[fast].mean() > scores[~fast].mean() + 0.2


def test_training_records_its_choices(classifier, records):
    info = classifier.info
    assert info["C"] > 0 and info["val_log_loss"] is not None
    assert info["train_subtasks"] + info["val_subtasks"] + info["held_out_test_subtasks"] == len(records)
    assert classifier.margin == classifiers.DEFAULT_MARGIN


@pytest.mark.parametrize("slow_speedup", [0.5, 1.1])
def test_the_routing_threshold_follows_time_saved_not_labels(records, slow_speedup):
    """Two worlds with the same labels (every slow subtask is below the 1.15x margin): where slow subtasks lose
    half their time the threshold keeps them off DSpark; where they still gain 10% it sends them too."""
    world = [
        record.model_copy(update={"speedup": slow_speedup}) if record.speedup < classifiers.DEFAULT_MARGIN else record
        for record in records
    ]
    assert [r.speedup >= 1.15 for r in world] == [r.speedup >= 1.15 for r in records]
    classifier = train(world)
    assert classifier.threshold == classifier.info["route_threshold"] and classifier.info["route_threshold_folds"] == 5
    test = [record for record in world if record.split == "test"]
    saved = time_saved(test)
    routed = classifier.score_many(record.request for record in test) >= classifier.threshold
    if slow_speedup < 1:
        assert saved[routed].sum() > saved.sum() + 0.2 * np.abs(saved[saved < 0]).sum()
        assert not routed[saved < 0].any()
    else:
        assert classifier.threshold == 0.0 and routed.all()


def test_time_saved_and_the_best_threshold():
    records = [
        Measurement(request={}, speedup=2.0, stats={"standard": {"wall_time_s": 3.0}}),
        Measurement(request={}, speedup=0.5),  # no standard time: weighs 1 s
    ]
    assert time_saved(records).tolist() == [1.5, -1.0]
    scores, saved = np.array([0.1, 0.3, 0.6, 0.9]), np.array([-1.0, 0.5, 0.5, 1.0])
    assert best_threshold(scores, saved) == 0.15  # the lowest that keeps the loser off and the rest on
    assert best_threshold(scores, np.abs(saved)) == THRESHOLD_GRID[0]
    assert best_threshold(scores, -np.abs(saved)) > scores.max()  # nothing gains: route nothing


def test_unmeasured_records_are_left_out_and_one_class_is_refused(records):
    unmeasured = [record.model_copy(update={"speedup": None}) for record in records[:5]]
    assert train(records + unmeasured).info == train(records).info
    with pytest.raises(TrainingError, match=r"all \d+ measured train-split subtasks are below the margin 100\.0x"):
        train(records, margin=100.0)


def test_save_load_round_trip(classifier, saved, records):
    loaded = DeterminismClassifier.load(saved)
    requests = [record.request for record in records[:20]]
    assert np.array_equal(loaded.score_many(requests), classifier.score_many(requests))
    assert loaded.margin == classifier.margin and loaded.info == classifier.info


def test_the_router_scores_with_the_weights_saved_beside_the_archive(classifier, saved, records):
    """Loading a skops archive imports every scikit-learn estimator first (4-5 s): the router reads the weights
    saved beside it instead, and gets the Pipeline's numbers; weights of another archive, or unreadable ones, are
    not trusted, and the archive loads."""
    requests = [record.request for record in records[:20]] + list(REQUEST_SHAPES.values())
    lean = classifiers.load_scorer(saved)
    assert isinstance(lean, ClassifierWeights) and isinstance(lean, Scorer)
    assert np.allclose(lean.score_many(requests), classifier.score_many(requests), atol=1e-12)
    assert np.allclose(lean.expected_speedup_many(requests), classifier.expected_speedup_many(requests), rtol=1e-9)
    assert [lean.score(r) for r in requests] == [classifier.score(r) for r in requests]
    assert (lean.threshold, lean.margin, lean.info) == (classifier.threshold, classifier.margin, classifier.info)
    other = train(records, margin=1.3).save(saved.with_name("other.skops"))
    weights_path(saved).replace(weights_path(other))  # the first archive's weights beside the second
    assert isinstance(classifiers.load_scorer(other), DeterminismClassifier)
    weights_path(other).write_bytes(b"not an npz")
    assert isinstance(classifiers.load_scorer(other), DeterminismClassifier)


def test_the_shipped_weights_are_the_shipped_archives():
    assert isinstance(classifiers.load_default(), ClassifierWeights)


def test_the_calibration_machines_curve_is_kept_with_the_classifier(records, tmp_path):
    profile = {"machine": "cpu:x|torch.bfloat16|threads=2", "steps_per_s": {"1": 24.0, "4": 22.0}}
    assert train(records).calibration_curve is None  # retrained from a log: taken as measured where it routes
    loaded = DeterminismClassifier.load(train(records, calibration_profile=profile).save(tmp_path / "c.skops"))
    assert loaded.calibration_curve.steps_per_s == {1: 24.0, 4: 22.0}
    assert loaded.info["calibration_profile"]["machine"] == profile["machine"]


class Foreign:
    """A type the loader was never told to trust."""

    def __init__(self) -> None:
        self.payload = [1, 2, 3]


def _write_random_bytes(path, classifier):
    path.write_bytes(os.urandom(2048))


def _write_pickle(path, classifier):
    path.write_bytes(pickle.dumps(classifier.pipeline))


def _write_skops_estimator(path, classifier):
    sio.dump(LogisticRegression(), path)


def _write_untrusted_type(path, classifier):
    sio.dump({"format": FORMAT, "version": 1, "margin": 1.15, "pipeline": Foreign()}, path)


def _write_other_version(path, classifier):
    sio.dump({"format": FORMAT, "version": 99, "margin": 1.15, "pipeline": classifier.pipeline}, path)


def _write_wrong_pipeline(path, classifier):
    sio.dump({"format": FORMAT, "version": FORMAT_VERSION, "margin": 1.15, "pipeline": LogisticRegression()}, path)


def _write_empty_zip(path, classifier):
    with zipfile.ZipFile(path, "w"):
        pass


@pytest.mark.parametrize(
    ("write", "message"),
    [
        (_write_random_bytes, "not a skops classifier file"),
        (_write_pickle, "not a skops classifier file"),
        (_write_empty_zip, "not a skops classifier file"),
        (_write_skops_estimator, "not a determinism classifier"),
        (_write_untrusted_type, r"does not trust: \S*Foreign"),
        (_write_other_version, "format version 99"),
        (_write_wrong_pipeline, "malformed classifier"),
    ],
)
def test_foreign_or_malformed_files_are_refused(write, message, classifier, tmp_path):
    path = tmp_path / "bad.skops"
    write(path, classifier)
    with pytest.raises(ClassifierLoadError, match=message) as raised:
        DeterminismClassifier.load(path)
    assert isinstance(raised.value, ModelLoadError)
    assert raised.value.to_openai()["error"]["param"] == "classifier"


def test_a_missing_file_names_the_command_that_makes_one(tmp_path):
    with pytest.raises(ClassifierLoadError, match="dspark-router calibrate"):
        DeterminismClassifier.load(tmp_path / "missing.skops")


def test_the_shipped_corpus_is_reproducible():
    assert [dataclasses.asdict(s) for s in read_jsonl(CORPUS_PATH)] == [dataclasses.asdict(s) for s in build_corpus()]
    assert set(template_splits(read_jsonl(CORPUS_PATH)).values()) == {"train", "val", "test"}


def test_the_shipped_classifier_loads_and_scores():
    """Fails until classifiers/data/default.skops is trained on the default model by ``dspark-router calibrate``."""
    shipped = classifiers.load_default()
    for request in [*REQUEST_SHAPES.values(), *(s.to_request_dict() for s in read_jsonl(CORPUS_PATH)[:50])]:
        assert 0.0 <= shipped.score(request) <= 1.0
    # Calibrated on the default model's measurements: losing a little on a wrong guess costs less than a missed win.
    assert shipped.threshold in THRESHOLD_GRID and shipped.threshold < 0.5
    assert shipped.calibration_curve is not None  # measured on a machine whose costs the router carries over


def test_the_shipped_classifier_ranks_a_copy_heavy_edit_above_a_sampled_story():
    """Requests in words of no template in the corpus: what each says about its answer must move the score and
    the expected speedup the way the measurements do (edits of given code gain most, sampled prose least)."""
    shipped = classifiers.load_default()
    code = (
        "def total(items):\n    result = 0\n    for item in items:\n        result += item.price\n    return result\n"
    )
    edit = {
        "messages": [{"role": "user", "content": f"Rename the variable result to subtotal:\n```python\n{code}```"}],
        "temperature": 0,
    }
    story = {"messages": [{"role": "user", "content": "Tell me a bedtime story about a dragon who loves tea."}]}
    assert shipped.score(edit) > shipped.score(story)
    assert shipped.expected_speedup(edit) > shipped.expected_speedup(story)
    label = {
        "messages": [{"role": "user", "content": "Is this review positive or negative? Reply with one word.\n\n"
                      "Review: the blender is loud but it works."}],
        "temperature": 0,
    }  # fmt: skip
    assert shipped.expected_speedup(edit) > shipped.expected_speedup(label)

"""Calibration end to end on a tiny random DSpark model: measure, retrain from the log, score, bench.

The tiny model's speedups mean nothing, so the margin is set from them to give both labels: these tests check
that the pipeline runs and its outputs hang together, not what it learns.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from backends.corpus.subtasks import generate_subtasks, write_jsonl
from benchmarks.route import cross_validate
from classifiers import DEFAULT_MARGIN, DEFAULT_MEASUREMENTS
from classifiers.gain import THRESHOLD_GRID
from classifiers.model import DeterminismClassifier
from classifiers.records import read_measurements, write_measurements
from router.cli import main
from tests.test_dspark import perturbed_heads_model

# Two kinds of short prompts (the tiny model's context is 512 tokens), three templates each: split_by_template
# puts one template of each kind in train, one in val and one in test.
TEMPLATES = (
    "classification/sentiment_v1",
    "classification/spam_v1",
    "classification/urgency_v1",
    "open_chat/opinion_v1",
    "open_chat/smalltalk_v1",
    "open_chat/weekend_v1",
)


@pytest.fixture(scope="module")
def calibrated(tiny_model_paths, tmp_path_factory):
    root = tmp_path_factory.mktemp("calibration")
    model = root / "tiny-dspark"
    perturbed_heads_model(tiny_model_paths["llama"]).save(model)
    corpus = write_jsonl(
        [generate_subtasks(1, seed=i, templates=[t])[0] for i, t in enumerate(TEMPLATES)], root / "c.jsonl"
    )
    measurements = root / "measurements.jsonl"
    args = ["--model", str(model), "--corpus", str(corpus), "--measurements", str(measurements)]
    assert main(["calibrate", *args, "--max-tokens", "8", "--measure-only"]) == 0
    return root, measurements


@pytest.fixture(scope="module")
def trained(calibrated):
    root, measurements = calibrated
    records, _ = read_measurements(measurements)
    margin = max(record.speedup for record in records if record.split == "train")
    out = root / "classifier.skops"
    assert main(["calibrate", "--from-log", str(measurements), "--margin", repr(margin), "--out", str(out)]) == 0
    return out, margin


def test_measurements_hold_both_pools_for_every_subtask(calibrated):
    _, measurements = calibrated
    records, rejected = read_measurements(measurements)
    assert not rejected and len(records) == len(TEMPLATES)
    assert sorted(record.template for record in records) == sorted(TEMPLATES)
    assert sorted(record.split for record in records) == ["test", "test", "train", "train", "val", "val"]
    for record in records:
        dspark, standard = record.stats["dspark"], record.stats["standard"]
        assert record.speedup > 0 and dspark["mean_accepted"] >= 1.0
        assert standard["completion_tokens"] <= 8 and dspark["completion_tokens"] <= 8
        assert standard["wall_time_s"] > 0 and dspark["wall_time_s"] > 0
        assert isinstance(dspark["same_output"], bool)
        assert record.request["max_tokens"] >= 8  # the subtask's own request is logged, not the capped one


def test_retraining_from_the_log_saves_a_classifier(trained):
    out, margin = trained
    classifier = DeterminismClassifier.load(out)
    assert classifier.margin == margin
    assert (classifier.info["train_subtasks"], classifier.info["val_subtasks"]) == (2, 2)
    # one fold per template; the threshold is the grid's that saved the most time on the tiny model's timed
    # speedups, which are noise: 0.0 where DSpark happened to win every subtask
    assert classifier.info["route_threshold_folds"] == 4 and classifier.threshold in THRESHOLD_GRID


def test_retraining_from_a_log_keeps_the_curve_of_the_machine_that_measured_it(calibrated, trained, tmp_path):
    """``--measured-with MODEL``: the curve stored with the model's drafters under the key of the machine the
    records were measured on goes into the classifier, for routers on other machines to carry its speedups
    over; records that name no machine were measured here; without the option there is no curve."""
    import torch

    from backends.dspark.curves import machine_key
    from backends.scheduling import PROFILE_FILE

    root, measurements = calibrated
    model = root / "tiny-dspark"
    here = machine_key(torch.device("cpu"), torch.float32)  # a tiny model runs in float32 on any CPU
    there = "cpu:Another CPU|torch.bfloat16|threads=8"
    (model / PROFILE_FILE).write_text(json.dumps({here: {"1": 50.0, "8": 40.0}, there: {"1": 90.0, "8": 80.0}}))
    records, _ = read_measurements(measurements)
    assert {record.machine for record in records} == {here}  # calibrate names the machine it measured on
    logs = {"here": tmp_path / "here.jsonl", "there": tmp_path / "there.jsonl", "unnamed": tmp_path / "none.jsonl"}
    write_measurements(records, logs["here"])
    write_measurements((r.model_copy(update={"machine": there}) for r in records), logs["there"])
    write_measurements((r.model_copy(update={"machine": None}) for r in records), logs["unnamed"])
    curves = {}
    for name, log in logs.items():
        out = tmp_path / f"{name}.skops"
        args = ["calibrate", "--from-log", str(log), "--margin", repr(trained[1]), "--out", str(out)]
        assert main([*args, "--measured-with", str(model), "--device", "cpu"]) == 0
        classifier = DeterminismClassifier.load(out)
        curves[name] = (classifier.info["calibration_profile"]["machine"], classifier.calibration_curve.steps_per_s)
    assert curves["here"] == curves["unnamed"] == (here, {1: 50.0, 8: 40.0})
    assert curves["there"] == (there, {1: 90.0, 8: 80.0})
    assert DeterminismClassifier.load(trained[0]).calibration_curve is None


def test_speedups_from_several_machines_are_carried_to_one_before_training(calibrated, trained, tmp_path, capsys):
    """A log gathered on two machines trains on one machine's speedups: the minority's are scaled by the two
    stored cost curves (as the router carries them), records of a machine with no stored curve are left out, and
    without ``--measured-with`` to find the curves the mix is refused by name rather than learnt as it is."""
    import torch

    from backends.dspark.curves import machine_key, stored_curves
    from backends.scheduling import PROFILE_FILE, SpsCurve, scaled_speedup
    from classifiers.calibrate import carried_to

    root, measurements = calibrated
    model = root / "tiny-dspark"
    here = machine_key(torch.device("cpu"), torch.float32)
    there, unknown = "cpu:Another CPU|torch.bfloat16|threads=8", "cpu:Unprofiled CPU|torch.float32|threads=2"
    (model / PROFILE_FILE).write_text(json.dumps({here: {"1": 50.0, "8": 40.0}, there: {"1": 90.0, "8": 80.0}}))
    records, _ = read_measurements(measurements)
    elsewhere = [r.model_copy(update={"machine": there}) for r in records[:3]]
    mixed = [*records, *elsewhere, records[3].model_copy(update={"machine": unknown})]

    kept, carried, left_out = carried_to(mixed, here, stored_curves(model / PROFILE_FILE))
    assert (dict(carried), dict(left_out), len(kept)) == ({there: 3}, {unknown: 1}, len(records) + 3)
    curve = {name: SpsCurve({1: rates[0], 8: rates[1]}) for name, rates in ((here, (50, 40)), (there, (90, 80)))}
    for original, moved in zip(elsewhere, kept[len(records) :], strict=True):
        assert moved.machine == here
        assert moved.speedup == pytest.approx(scaled_speedup(original.speedup, curve[there], curve[here]))
        assert moved.speedup < original.speedup  # verifying costs relatively more here than there

    log = tmp_path / "mixed.jsonl"
    write_measurements(mixed, log)
    args = ["calibrate", "--from-log", str(log), "--margin", repr(trained[1]), "--out", str(tmp_path / "c.skops")]
    assert main(args) == 2
    assert json.loads(capsys.readouterr().err.strip().splitlines()[-1])["error"]["param"] == "measured_with"
    assert main([*args, "--measured-with", str(model), "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert f"carried 3 speedups from {there}" in err and "left out 1 records" in err
    assert DeterminismClassifier.load(tmp_path / "c.skops").info["calibration_profile"]["machine"] == here


def test_score_prints_the_score(trained, tmp_path, capsys):
    out, margin = trained
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"messages": [{"role": "user", "content": "Return JSON."}], "temperature": 0}))
    capsys.readouterr()
    assert main(["score", "--request", str(request), "--json", "--classifier", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert 0.0 <= printed["score"] <= 1.0 and printed["margin"] == margin
    assert main(["score", "What do you think about rain?", "--classifier", str(out)]) == 0
    assert f"P(DSpark speedup >= {margin}x)" in capsys.readouterr().out


def test_bench_route_reports_the_metrics(calibrated, trained, tmp_path):
    _, measurements = calibrated
    out, _ = trained
    report_path, plot_path = tmp_path / "route.json", tmp_path / "route.png"
    args = ["--measurements", str(measurements), "--classifier", str(out), "--latency-calls", "50", "--cv-folds", "0"]
    args += ["--online-batch", "1", "--online-orders", "2", "--online-shadow", "1", "--new-mix", "none"]
    assert main(["bench", "route", *args, "--json", str(report_path), "--plot", str(plot_path)]) == 0
    report = json.loads(report_path.read_text())
    assert report["subtasks"] == 2 and report["split"] == "test" and "cross_validation" not in report
    for key in ("auroc", "oracle_gain_ratio", "all_dspark_gain_ratio", "all_standard_gain_ratio", "p50_us", "p99_us"):
        assert key in report
    assert 0 < report["p50_us"] <= report["p99_us"]
    online = report["online"]  # every test subtask logged and retrained on, one at a time, in two orders
    assert [run["logged"] for run in online["orders"]] == [2, 2] and online["batch"] == 1
    assert plot_path.stat().st_size > 1000


def test_bench_route_replays_a_new_mix_with_the_corpus_carried_to_its_machine(calibrated, trained, tmp_path):
    """``--new-mix``: live traffic measured on another machine is replayed with every corpus record as the
    fitted part, carried to that machine by the stored curves, and logged as it arrives; where no curve of the
    mix's machine is stored nothing puts the two in one machine's units, and the replay is left out."""
    _, measurements = calibrated
    out, _ = trained
    records, _ = read_measurements(measurements)
    here, there = records[0].machine, "cpu:Another CPU|torch.bfloat16|threads=8"
    profiles, mix, report_path = tmp_path / "sps.json", tmp_path / "mix.jsonl", tmp_path / "route.json"
    curve = {"1": 50.0, "8": 40.0}  # one curve under both names: carrying scales by 1, so both labels stay
    profiles.write_text(json.dumps({here: curve, there: curve}))
    live = {"machine": there, "template": None, "split": None, "kind": None}
    write_measurements((record.model_copy(update=live) for record in records), mix)
    args = ["--measurements", str(measurements), "--classifier", str(out), "--latency-calls", "5", "--cv-folds", "0"]
    args += ["--online-batch", "2", "--online-orders", "1", "--online-shadow", "1", "--new-mix", str(mix)]
    args += ["--profiles", str(profiles), "--retest", "none", "--carry-over", "none", "--json", str(report_path)]
    assert main(["bench", "route", *args]) == 0
    replay = json.loads(report_path.read_text())["new_mix"]
    assert (replay["machine"], replay["corpus_machine"], replay["carried"]) == (there, here, len(records))
    assert replay["subtasks"] == len(records) and [run["logged"] for run in replay["orders"]] == [len(records)]
    assert replay["all_standard_time_over_oracle"] >= 1.0 and replay["all_dspark_time_over_oracle"] >= 1.0

    profiles.write_text(json.dumps({here: curve}))
    assert main(["bench", "route", *args]) == 0
    assert json.loads(report_path.read_text())["new_mix"] is None


def test_bench_route_refuses_one_fold(calibrated, capsys):
    _, measurements = calibrated
    assert main(["bench", "route", "--measurements", str(measurements), "--cv-folds", "1"]) == 2
    assert json.loads(capsys.readouterr().err.strip().splitlines()[-1])["error"]["param"] == "cv_folds"


def test_cross_validation_on_the_shipped_measurements_saves_time_against_the_standard_pool():
    """Template-grouped folds of the shipped measurements, refitted as calibrate fits: every template is held
    out once. The shipped measurements are the pools' default (copied blocks alone, kept by their match) on the
    packed engine on an Intel Xeon, where DSpark's median speedup by kind is 0.91x (classification, creative
    writing) to 1.30x (code edits): DSpark is 1.15x faster or more on 26% of the subtasks, and 48 of them measured
    twice correlate 0.79 in log speedup. On held-out templates the classifier's scores must rank the faster
    subtasks (AUROC 0.79), its routing must save time against the standard pool and at least nine tenths of what
    sending everything to DSpark saves (0.66 of the oracle's saving, all-DSpark 0.48), and its expected-gain model,
    what the default ``time_saved`` objective routes by, must rank speedups it never saw (log correlation 0.49)."""
    records, _ = read_measurements(DEFAULT_MEASUREMENTS)
    summary = cross_validate(records, DEFAULT_MARGIN, threshold=None, folds=5)
    assert summary["folds"] == 5 and summary["subtasks"] == len(records)
    assert summary["oracle_gain_ratio_folds"] >= 1 and summary["auroc_mean"] > 0.6
    assert summary["oracle_gain_ratio_mean"] > max(0.0, 0.9 * summary["all_dspark_gain_ratio_mean"])
    assert summary["gain_log_correlation"] > 0.2
    by_kind = summary["by_kind"]
    assert sum(row["subtasks"] for row in by_kind.values()) == len(records)
    for row in by_kind.values():  # what was sent saves its gains and pays its losses; the rest was missed
        assert row["saved_s"] <= row["oracle_saved_s"] + 1e-9 and row["missed_s"] >= 0 and row["lost_s"] >= 0
        assert row["saved_s"] + row["missed_s"] - row["oracle_saved_s"] == pytest.approx(-row["lost_s"], abs=1e-9)


def test_one_label_only_is_a_clear_error(calibrated, tmp_path, capsys):
    _, measurements = calibrated
    args = ["calibrate", "--from-log", str(measurements), "--margin", "1e9", "--out", str(tmp_path / "c.skops")]
    assert main(args) == 2
    error = json.loads(capsys.readouterr().err.strip().splitlines()[-1])["error"]
    assert error["param"] == "margin" and "below the margin" in error["message"]
    assert not (tmp_path / "c.skops").exists()


def test_time_over_the_oracle_is_one_only_for_the_oracle_s_own_routing():
    """The replay's readable unit on a mix where DSpark saves little: each shipped agent-mix request on the pool
    it was sent to, over each on its faster pool."""
    from classifiers import DEFAULT_AGENT_MIX_MEASUREMENTS
    from classifiers.gain import time_over_oracle

    records, _ = read_measurements(DEFAULT_AGENT_MIX_MEASUREMENTS)
    faster = np.array([record.speedup > 1 for record in records])
    assert time_over_oracle(records, faster) == pytest.approx(1.0)
    for routed in (~faster, np.ones(len(records), dtype=bool), np.zeros(len(records), dtype=bool)):
        assert time_over_oracle(records, routed) > 1.0


class Stalled:
    """A real pool whose runs, once ``stalled`` is set, report the times of a machine another process holds: the
    filter under test reads only the times."""

    def __init__(self, backend) -> None:
        self.backend, self.loaded, self.stalled = backend, backend.loaded, False

    def complete(self, request):
        result = self.backend.complete(request)
        if self.stalled:
            result.stats.wall_time_s *= 50
        return result


def test_a_subtask_still_disturbed_after_its_retries_is_skipped_not_kept(calibrated):
    from backends.corpus.subtasks import read_jsonl
    from classifiers.calibrate import BLOCK, RETRIES, TYPICAL_AFTER, load_pools, measure

    root, _ = calibrated
    subtasks = [(subtask, "train") for subtask in read_jsonl(root / "c.jsonl")] * 2
    assert TYPICAL_AFTER < BLOCK < len(subtasks)
    pools = load_pools(str(root / "tiny-dspark"))
    pools["standard"] = Stalled(pools["standard"])
    skipped: list[str] = []
    records = []
    for record in measure(pools, subtasks, max_tokens=8, on_skip=lambda subtask, why: skipped.append(why)):
        records.append(record)
        pools["standard"].stalled = len(records) == BLOCK  # the first block is clean, every later run stalls
    assert len(records) == BLOCK and len(skipped) == len(subtasks) - BLOCK
    assert all(f"x slower than usual on all {RETRIES + 1} tries" in why for why in skipped)


def test_disturbance_reads_the_forwards_after_the_prompt_s():
    """A long prompt's pass is not a disturbance: the time a forward takes is read after the first token, and
    only where a run had enough forwards to tell."""
    from classifiers.calibrate import _disturbance, _seconds_per_forward

    typical = {"standard": [0.01] * 5, "dspark": [0.02] * 5}
    long_prompt = {
        "standard": {"wall_time_s": 0.95, "first_token_s": 0.9, "forward_passes": 6},
        "dspark": {"wall_time_s": 0.93, "first_token_s": 0.92, "forward_passes": 2},
    }
    assert _seconds_per_forward(long_prompt) == pytest.approx({"standard": 0.01})
    assert _disturbance(_seconds_per_forward(long_prompt), typical) == pytest.approx(1.0)
    stalled = {"standard": {"wall_time_s": 5.0, "first_token_s": 0.1, "forward_passes": 6}}
    assert _disturbance(_seconds_per_forward(stalled), typical) > 50

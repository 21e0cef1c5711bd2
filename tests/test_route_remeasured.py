"""The subtasks measured again: the noise ceiling (same machine) and the carry-over to another machine's curve."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.report import machine_name
from benchmarks.route_remeasured import carry_over, noise_ceiling
from classifiers.records import Measurement

HERE = "cpu:Cheap Verify CPU|torch.bfloat16|threads=2"
THERE = "cpu:Dear Verify CPU|torch.float32|threads=2"
# Verifying a round of 4 tokens costs 1.0 step here and 2.0 steps there: a speedup carries over at half.
CURVES = {HERE: {"1": 20.0, "4": 20.0, "8": 20.0}, THERE: {"1": 20.0, "4": 10.0, "8": 5.0}}


def _record(index: int, speedup: float, machine: str, standard_s: float = 2.0) -> Measurement:
    return Measurement(
        request={"messages": [{"role": "user", "content": f"request {index}"}], "temperature": index % 2 * 0.7},
        speedup=speedup,
        stats={"standard": {"wall_time_s": standard_s}},
        machine=machine,
    )


@pytest.fixture
def profiles(tmp_path):
    path = tmp_path / "dspark_sps.json"
    path.write_text(json.dumps(CURVES))
    return path


def test_a_label_measured_twice_alike_reaches_the_oracle():
    speedups = [0.6, 0.8, 1.3, 1.9, 2.4, 0.9]
    first = [_record(i, s, HERE) for i, s in enumerate(speedups)]
    ceiling = noise_ceiling(first, [_record(i, s * 1.05, HERE) for i, s in enumerate(speedups)])
    assert ceiling["pairs"] == 6 and ceiling["log_correlation"] == pytest.approx(1.0)
    assert ceiling["faster_label_agreement"] == ceiling["remembered_auroc_faster"] == 1.0
    assert ceiling["remembered_oracle_gain_ratio"] == pytest.approx(1.0)
    assert ceiling["all_dspark_gain_ratio"] < 1.0  # the slow ones cost time on DSpark
    assert noise_ceiling(first, [_record(9, 1.0, HERE)]) is None  # too few pairs to say anything


def test_speedups_remeasured_where_verifying_costs_twice_are_predicted_by_the_curves(profiles):
    """A machine where a verifying round costs two steps halves every speedup: labels as measured would send
    the 1.3x-1.9x subtasks to a DSpark that is slower there; carried over by the curves, they stay standard."""
    speedups = [0.6, 1.3, 1.9, 2.4, 3.0, 1.5]
    here = [_record(i, s, HERE) for i, s in enumerate(speedups)]
    there = [_record(i, s / 2, THERE) for i, s in enumerate(speedups)]
    carried = carry_over(here, there, profiles)
    assert (carried["measured_on"], carried["remeasured_on"]) == (HERE, THERE)
    assert carried["carry_factor"] == pytest.approx(0.5)
    assert carried["mean_log_ratio_carried"] == pytest.approx(0.0, abs=1e-9)
    assert carried["mean_log_ratio_measured"] == pytest.approx(math.log(0.5))
    assert carried["faster_label_agreement_carried"] == 1.0 and carried["carried_oracle_gain_ratio"] == 1.0
    assert carried["faster_label_agreement_measured"] == 0.5  # 1.3x, 1.5x and 1.9x are slower there
    assert carried["measured_oracle_gain_ratio"] < 0  # the labels as measured lose time there


def test_carry_over_needs_two_machines_with_curves(profiles):
    here = [_record(i, 1.5, HERE) for i in range(4)]
    assert carry_over(here, [_record(i, 1.2, HERE) for i in range(4)], profiles) is None  # the same machine
    unknown = "cpu:Unprofiled|torch.float32|threads=2"
    assert carry_over(here, [_record(i, 1.2, unknown) for i in range(4)], profiles) is None
    assert carry_over(here, [_record(i, 1.2, None) for i in range(4)], profiles) is None  # names no machine


def test_a_machine_key_reads_as_words():
    assert machine_name(THERE) == "Dear Verify CPU in float32"

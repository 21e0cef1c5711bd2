"""The same subtasks measured again: on the machine that measured the labels (how repeatable a label is) and on
another machine (how well speedups carry over from one machine's cost curve to another's).

Both are ceilings on what ``bench route`` can show, not properties of the classifier: a router can learn a label
no better than it repeats, and a classifier measured on one machine routes another only as well as the scaling
by the two machines' cost curves (:func:`backends.scheduling.scaled_speedup`) carries its speedups over.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from backends.dspark.curves import carry_factor, stored_curves
from classifiers.calibrate import measured_on
from classifiers.gain import oracle_share, time_saved
from classifiers.records import Measurement

MIN_PAIRS = 3


def _pairs(records: Sequence[Measurement], again: Sequence[Measurement]) -> list[tuple[Measurement, Measurement]]:
    """(first, second) measurement of each request measured in both."""
    first = {record.canonical_request(): record for record in records if record.speedup is not None}
    return [
        (first[r.canonical_request()], r) for r in again if r.speedup is not None and r.canonical_request() in first
    ]


def _correlation(a: np.ndarray, b: np.ndarray) -> float | None:
    return float(np.corrcoef(a, b)[0, 1]) if len(a) > 2 else None


def _auroc(labels: np.ndarray, scores: np.ndarray) -> float | None:
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(labels, scores)) if 0 < labels.sum() < len(labels) else None


def noise_ceiling(records: Sequence[Measurement], retest: Sequence[Measurement]) -> dict[str, Any] | None:
    """How far any router can learn the measured labels: the same requests measured twice. Routing each retested
    request by its first measurement (what a router that remembered every request would do) against the oracle
    of the second is the most that time saved can reach while one measurement is this noisy, and ranking the
    second's label 'faster' by the first's speedup the most that AUROC can."""
    pairs = _pairs(records, retest)
    if len(pairs) < MIN_PAIRS:
        return None
    before = np.log([a.speedup for a, _ in pairs])
    after = np.log([b.speedup for _, b in pairs])
    greedy = np.array([a.request.get("temperature") == 0 for a, _ in pairs])
    saved = time_saved([b for _, b in pairs])
    return {
        "pairs": len(pairs),
        "log_correlation": _correlation(before, after),
        "greedy_log_correlation": _correlation(before[greedy], after[greedy]),
        "sampled_log_correlation": _correlation(before[~greedy], after[~greedy]),
        "faster_label_agreement": float(((before > 0) == (after > 0)).mean()),
        "remembered_auroc_faster": _auroc(after > 0, before),
        "remembered_oracle_gain_ratio": oracle_share(saved, before > 0),
        "all_dspark_gain_ratio": oracle_share(saved, np.ones(len(saved), dtype=bool)),
    }


def carry_over(
    records: Sequence[Measurement], elsewhere: Sequence[Measurement], profiles: Path
) -> dict[str, Any] | None:
    """The labels' requests measured on another machine, against the labels as measured and as carried over by
    the two machines' curves in ``profiles`` (a ``dspark_sps.json``), as the router carries a classifier's
    speedups. Routing there by each label carried over, against that machine's own oracle, is the most a
    classifier measured on the first machine can save on the second; routing by the labels as they are shows
    what the carrying is worth. None where the files name no two machines with stored curves."""
    pairs = _pairs(records, elsewhere)
    machines = measured_on([a for a, _ in pairs]), measured_on([b for _, b in pairs])
    curves = stored_curves(profiles)
    if len(pairs) < MIN_PAIRS or None in machines or machines[0] == machines[1] or not set(machines) <= set(curves):
        return None
    factor = carry_factor(curves, *machines)
    measured = np.log([a.speedup for a, _ in pairs])
    carried = measured + np.log(factor)
    there = np.log([b.speedup for _, b in pairs])
    saved = time_saved([b for _, b in pairs])
    return {
        "pairs": len(pairs),
        "measured_on": machines[0],
        "remeasured_on": machines[1],
        "carry_factor": factor,
        "log_correlation": _correlation(measured, there),
        "mean_log_ratio_measured": float(np.mean(there - measured)),
        "mean_log_ratio_carried": float(np.mean(there - carried)),
        "faster_label_agreement_measured": float(((measured > 0) == (there > 0)).mean()),
        "faster_label_agreement_carried": float(((carried > 0) == (there > 0)).mean()),
        "dspark_faster_share": float((there > 0).mean()),
        "carried_oracle_gain_ratio": oracle_share(saved, carried > 0),
        "measured_oracle_gain_ratio": oracle_share(saved, measured > 0),
        "all_dspark_gain_ratio": oracle_share(saved, np.ones(len(saved), dtype=bool)),
    }

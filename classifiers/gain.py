"""Time saved by routing subtasks to DSpark: what the routing threshold maximises and ``bench route`` reports.

Sending a subtask to DSpark saves ``t_standard * (1 - 1/speedup)`` of the time the standard pool would take
(negative when DSpark is slower). The two sides are not symmetric: a subtask DSpark wins on saves up to half or
more of its time, one it loses on costs a few percent, and many below the classifier's margin still save a
little. So the score at which routing to DSpark starts to pay is well below 0.5, and it is measured, not
assumed: :func:`best_threshold` picks it from scores of subtasks the classifier was not fitted on.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from classifiers.records import Measurement

# 0 sends every subtask to DSpark, 1 only those the classifier is certain of.
THRESHOLD_GRID: tuple[float, ...] = tuple(round(0.05 * i, 2) for i in range(21))


def standard_times(records: Sequence[Measurement]) -> np.ndarray:
    """Each record's standard-pool wall time, its weight in time saved; 1 s where the stats do not hold it."""
    return np.array([record.standard_time_s or 1.0 for record in records])


def time_saved(records: Sequence[Measurement]) -> np.ndarray:
    """Seconds each measured record saves on DSpark."""
    speedups = np.array([record.speedup for record in records], dtype=float)
    return standard_times(records) * (1.0 - 1.0 / speedups)


def oracle_saved(saved: np.ndarray) -> float:
    """What an oracle that knows every speedup saves: it sends exactly the subtasks DSpark speeds up."""
    return float(saved[saved > 0].sum())


def oracle_share(saved: np.ndarray, routed: np.ndarray) -> float | None:
    """The share of the oracle's saving that sending the ``routed`` subtasks (a mask) to DSpark saves; None where
    the oracle saves nothing."""
    oracle = oracle_saved(saved)
    return float(saved[routed].sum()) / oracle if oracle > 0 else None


def time_over_oracle(records: Sequence[Measurement], routed: np.ndarray) -> float:
    """The time of serving ``records`` as routed (a mask: True to DSpark) over the oracle's, each on the pool it
    chose: unlike a share of the oracle's saving, it stays readable where DSpark saves almost nothing."""
    standard = standard_times(records)
    dspark = standard / np.array([record.speedup for record in records])
    return float(np.where(routed, dspark, standard).sum() / np.minimum(dspark, standard).sum())


def best_threshold(scores: np.ndarray, saved: np.ndarray) -> float:
    """The grid threshold whose routing (score >= threshold to DSpark) saves the most time; the lowest on a tie."""
    totals = [float(saved[scores >= threshold].sum()) for threshold in THRESHOLD_GRID]
    return THRESHOLD_GRID[int(np.argmax(totals))]

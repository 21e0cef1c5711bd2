"""What retraining from the router's own log (``calibrate --from-log`` on shadow replays) adds to routing.

A stream of live traffic is replayed in seeded arrival orders: a ``shadow`` share of the requests is measured on
both pools (as ``policy.shadow`` does) and logged like live traffic (no split, no template, no kind), and every
``batch`` requests the classifier is retrained on what it was fitted on plus the log. Each request is routed by
the classifier of before it arrived, so none is judged by a classifier that had seen it.

* :func:`online` streams the held-out templates of the generator's own corpus;
* :func:`new_mix` streams requests the generator never wrote (hand-written agent traffic measured on one machine,
  :data:`classifiers.DEFAULT_AGENT_MIX_MEASUREMENTS`), fitted on the whole corpus carried to that machine by the
  stored cost curves, so the corpus and the log speak of one machine's speedups as ``calibrate --from-log`` has them.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from backends.dspark.curves import stored_curves
from classifiers.calibrate import carried_to, measured_on
from classifiers.gain import oracle_share, time_over_oracle, time_saved
from classifiers.records import Measurement

if TYPE_CHECKING:
    from classifiers.model import DeterminismClassifier

LIVE = {"split": None, "template": None, "kind": None}
"""What a log record of live traffic lacks."""


def online(
    classifier: DeterminismClassifier,
    fitted: Sequence[Measurement],
    stream: Sequence[Measurement],
    shadow: float,
    batch: int,
    orders: int,
) -> dict[str, Any]:
    """The share of the oracle's saving, and the time over the oracle's, of routing ``stream`` while the
    classifier is retrained from a shadow-measured log every ``batch`` requests, for ``orders`` seeded arrival
    orders; beside them, the static ``classifier`` and each pool alone on the same requests. ``second_half``: the
    same ratios over the later half of the stream, once the log holds some."""
    from backends.progress import JobProgress
    from classifiers.train import train

    static = classifier.score_many(record.request for record in stream) >= classifier.threshold
    everything = np.ones(len(stream), dtype=bool)
    runs = []
    with JobProgress() as progress:
        job = progress.add_job("online retraining", total=orders * math.ceil(len(stream) / batch))
        for order in range(orders):
            rng = random.Random(order)
            positions = list(range(len(stream)))
            rng.shuffle(positions)
            arrivals = [stream[i] for i in positions]
            current, log = classifier, []
            routed = np.zeros(len(arrivals), dtype=bool)
            for start in range(0, len(arrivals), batch):
                part = arrivals[start : start + batch]
                routed[start : start + len(part)] = current.score_many(r.request for r in part) >= current.threshold
                log += [record.model_copy(update=LIVE) for record in part if rng.random() < shadow]
                current = train([*fitted, *log], classifier.margin)
                progress.step(job, status=f"order {order}: {len(log)} logged")
            saved, half = time_saved(arrivals), slice(len(arrivals) // 2, None)
            runs.append(
                {
                    "oracle_gain_ratio": oracle_share(saved, routed),
                    "second_half_oracle_gain_ratio": oracle_share(saved[half], routed[half]),
                    "static_second_half_oracle_gain_ratio": oracle_share(saved[half], static[positions][half]),
                    "time_over_oracle": time_over_oracle(arrivals, routed),
                    "second_half_time_over_oracle": time_over_oracle(arrivals[half], routed[half]),
                    "static_second_half_time_over_oracle": time_over_oracle(arrivals[half], static[positions][half]),
                    "sent_to_dspark": int(routed.sum()),
                    "logged": len(log),
                }
            )
    summary: dict[str, Any] = {
        "shadow": shadow,
        "batch": batch,
        "subtasks": len(stream),
        "static_oracle_gain_ratio": oracle_share(time_saved(stream), static),
        "all_dspark_gain_ratio": oracle_share(time_saved(stream), everything),
        "static_time_over_oracle": time_over_oracle(stream, static),
        "all_dspark_time_over_oracle": time_over_oracle(stream, everything),
        "all_standard_time_over_oracle": time_over_oracle(stream, ~everything),
        "static_sent_to_dspark": int(static.sum()),
        "orders": runs,
    }
    for name in runs[0] if runs else ():
        values = [run[name] for run in runs if run[name] is not None]
        summary[f"{name}_mean"] = float(np.mean(values)) if values else None
    return summary


def new_mix(
    records: Sequence[Measurement],
    mix: Sequence[Measurement],
    profiles: Path,
    margin: float,
    shadow: float,
    batch: int,
    orders: int,
) -> dict[str, Any] | None:
    """:func:`online` on ``mix``, a request mix the classifier was not fitted on, with every measured record of the
    corpus (``records``, all splits) as the fitted part: carried to the machine that measured the mix where the
    two differ, and the static classifier trained on that. None where no stored curve carries them there."""
    from classifiers.train import train

    stream = [record for record in mix if record.speedup is not None]
    if not stream:
        return None
    corpus = [
        record.model_copy(update={"split": "val" if record.resolved_split == "val" else "train"})
        for record in records
        if record.speedup is not None
    ]
    machine, corpus_machine = measured_on(stream), measured_on(corpus)
    carried = 0
    if machine is not None and corpus_machine not in (None, machine):
        curves = stored_curves(profiles)
        if not {machine, corpus_machine} <= set(curves):
            return None
        corpus, moved, _ = carried_to(corpus, machine, curves)
        carried = sum(moved.values())
    if not corpus:
        return None
    report = online(train(corpus, margin), corpus, stream, shadow, batch, orders)
    speedups, corpus_speedups = (np.array([record.speedup for record in part]) for part in (stream, corpus))
    return {
        "machine": machine,
        "corpus_machine": corpus_machine,
        "carried": carried,
        "dspark_faster_share": float((speedups > 1).mean()),
        "median_speedup": float(np.median(speedups)),
        "corpus_dspark_faster_share": float((corpus_speedups > 1).mean()),
        "corpus_median_speedup": float(np.median(corpus_speedups)),
        **report,
    }

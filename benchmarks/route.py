"""``dspark-router bench route``: how well the determinism classifier routes subtasks it never saw, and how fast.

On the test split of the measurements (templates the classifier was not fitted on) it reports

* ``auroc``: how well the score ranks subtasks whose speedup reaches the classifier's margin above the rest,
  and ``auroc_faster`` those on which DSpark is faster at all (speedup > 1), the label the targets name;
* time saved (:mod:`classifiers.gain`): sending a subtask to DSpark saves ``t_standard * (1 - 1/speedup)``
  (negative when DSpark is slower). The classifier sends the subtasks scoring >= its threshold (the one it was
  calibrated to route at, as the router does, or ``--threshold``); the oracle, which knows every measured
  speedup, sends exactly those with speedup > 1. ``oracle_gain_ratio`` is the classifier's saving over the
  oracle's, ``all_dspark_gain_ratio`` and ``all_standard_gain_ratio`` (always 0) the same for one pool alone;
* ``cross_validation``: the same ranking and time saved over template-grouped folds of all the measurements,
  each fold held out in turn while :func:`classifiers.train.train` refits on the rest, threshold included (so
  the threshold is chosen without the fold it is judged on): one test split of a few templates per kind swings
  with which templates it drew, the mean and spread over folds do not;
* ``online`` (:mod:`benchmarks.route_online`): what retraining from the router's own log (``calibrate
  --from-log``) adds on templates it never saw: a ``--online-shadow`` share of the test subtasks, arriving in
  seeded orders, is measured on both pools and logged like live traffic, and every ``--online-batch`` requests the
  classifier is retrained on its measurements plus the log. Not the target's metric: the target is for a
  classifier that has never seen these templates;
* ``new_mix``: the same on a request mix the generator never wrote (``--new-mix``: hand-written agent requests),
  fitted on the whole corpus: whether the log teaches the classifier traffic unlike what it was fitted on;
* ``cross_validation.gain_log_correlation``: the expected-gain model's predictions against the measured
  speedups, each out of fold; ``cross_validation.by_kind``: where routing saves, misses and loses time;
* ``noise_ceiling`` and ``carry_over`` (:mod:`benchmarks.route_remeasured`): the same subtasks measured again,
  on this machine and on another: how far any router can learn these labels, and carry them to another CPU;
* ``p50_us`` / ``p99_us``: the latency of scoring one subtask in-process, as the router does per request, and
  ``cpu_p50_us`` / ``cpu_p99_us``, the CPU time of those calls. Judge the target on an otherwise idle machine:
  on busy cores the wall-clock p99 measures the scheduler, not the classifier.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from backends.default_model import DEFAULT_DRAFTERS
from backends.errors import InvalidRequestError
from backends.scheduling import PROFILE_FILE
from benchmarks.output import write_json
from benchmarks.route_online import new_mix, online
from benchmarks.route_remeasured import carry_over, noise_ceiling
from classifiers import (
    DEFAULT_AGENT_MIX_MEASUREMENTS,
    DEFAULT_CARRY_OVER,
    DEFAULT_CLASSIFIER,
    DEFAULT_MEASUREMENTS,
    DEFAULT_RETEST,
)
from classifiers.gain import oracle_saved, oracle_share, standard_times, time_saved
from classifiers.records import Measurement, read_measurements

if TYPE_CHECKING:
    from classifiers.model import DeterminismClassifier

TARGETS = {"auroc_faster": 0.85, "oracle_gain_ratio": 0.9, "p99_us": 200.0, "gain_log_correlation": 0.6}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--measurements", default=str(DEFAULT_MEASUREMENTS), help="measurements JSONL (from calibrate)")
    p.add_argument("--classifier", default=str(DEFAULT_CLASSIFIER), help="classifier file (default: the shipped one)")
    p.add_argument("--split", choices=["train", "val", "test"], default="test")
    p.add_argument(
        "--threshold", type=float, help="route to DSpark when score >= threshold (default: the classifier's own)"
    )
    p.add_argument("--latency-calls", type=int, default=2000, help="single-subtask scoring calls to time")
    p.add_argument("--cv-folds", type=int, default=5, help="template-grouped cross-validation folds (0: skip)")
    p.add_argument("--online-shadow", type=float, default=0.2, help="share of the stream measured and logged")
    p.add_argument(
        "--online-batch", type=int, default=20, help="requests between retrainings (0: skip online and --new-mix)"
    )
    p.add_argument("--online-orders", type=int, default=3, help="seeded arrival orders to average over")
    p.add_argument(
        "--new-mix",
        default=str(DEFAULT_AGENT_MIX_MEASUREMENTS),
        help="measurements of a request mix the corpus never held, replayed like --online; 'none' to skip",
    )
    p.add_argument(
        "--retest",
        default=str(DEFAULT_RETEST),
        help="the same subtasks measured again (calibrate --sample): the noise ceiling; 'none' to skip",
    )
    p.add_argument(
        "--carry-over",
        default=str(DEFAULT_CARRY_OVER),
        help="the same subtasks measured on another machine: how well speedups carry over; 'none' to skip",
    )
    p.add_argument(
        "--profiles",
        default=str(DEFAULT_DRAFTERS / PROFILE_FILE),
        help="the cost curves of both machines (dspark_sps.json) for --carry-over",
    )
    p.add_argument("--json", metavar="PATH", help="write the report as JSON")
    p.add_argument("--plot", metavar="PNG", help="draw the ROC curve and score against speedup")


def evaluate(scores: np.ndarray, records: Sequence[Measurement], margin: float, threshold: float) -> dict[str, Any]:
    """Ranking, calibration and time saved of routing ``records`` by ``scores``."""
    from sklearn.metrics import brier_score_loss, roc_auc_score

    speedups = np.array([record.speedup for record in records])
    labels = speedups >= margin
    saved = time_saved(records)
    routed = scores >= threshold
    everything = np.ones(len(records), dtype=bool)
    both_classes = 0 < labels.sum() < len(labels)
    return {
        "subtasks": len(records),
        "margin": margin,
        "threshold": threshold,
        "positive_rate": float(labels.mean()),
        "auroc": float(roc_auc_score(labels, scores)) if both_classes else None,
        "auroc_faster": float(roc_auc_score(speedups > 1, scores)) if 0 < (speedups > 1).sum() < len(labels) else None,
        "brier": float(brier_score_loss(labels, scores, labels=[False, True])),
        "routed_to_dspark": int(routed.sum()),
        "standard_time_s": float(standard_times(records).sum()),
        "saved_s": {
            "classifier": float(saved[routed].sum()),
            "oracle": oracle_saved(saved),
            "all_dspark": float(saved.sum()),
            "all_standard": 0.0,
        },
        "oracle_gain_ratio": oracle_share(saved, routed),
        "all_dspark_gain_ratio": oracle_share(saved, everything),
        "all_standard_gain_ratio": oracle_share(saved, ~everything),
    }


def cross_validate(
    records: Sequence[Measurement], margin: float, threshold: float | None, folds: int
) -> dict[str, Any]:
    """Mean and spread of AUROC and gain ratios over template-grouped folds. Each fold's templates are held out
    while the rest is refitted exactly as ``calibrate`` fits (C picked on the records of the validation split,
    the routing threshold on grouped folds of the rest, unless ``threshold`` fixes one). Beside them, over all
    the out-of-fold predictions: the expected-gain model's log correlation with the measured speedups, and per
    kind what the classifier's routing saved, missed and lost against the oracle's."""
    from sklearn.model_selection import GroupKFold

    from backends.progress import JobProgress
    from classifiers.train import train

    measured = [record for record in records if record.speedup is not None]
    groups = [record.group for record in measured]
    reports = []
    routed = np.zeros(len(measured), dtype=bool)
    predicted = np.empty(len(measured))
    with JobProgress() as progress:
        job = progress.add_job("cross-validate", total=folds)
        for fit_rows, held_rows in GroupKFold(folds).split(measured, groups=groups):
            fit = [measured[i] for i in fit_rows]
            fit = [r.model_copy(update={"split": "val" if r.resolved_split == "val" else "train"}) for r in fit]
            held = [measured[i] for i in held_rows]
            classifier = train(fit, margin)
            scores = classifier.score_many(record.request for record in held)
            chosen = classifier.threshold if threshold is None else threshold
            reports.append(evaluate(scores, held, margin, chosen))
            routed[held_rows] = scores >= chosen
            predicted[held_rows] = np.log(classifier.expected_speedup_many(record.request for record in held))
            gain = reports[-1]["oracle_gain_ratio"]  # None: no held-out subtask gains on DSpark
            progress.step(job, status="no gain to find" if gain is None else f"oracle gain {gain:.3f}")
    summary: dict[str, Any] = {
        "folds": folds,
        "subtasks": len(measured),
        "thresholds": [report["threshold"] for report in reports],
    }
    for name in ("auroc", "auroc_faster", "oracle_gain_ratio", "all_dspark_gain_ratio"):
        values = np.array([report[name] for report in reports if report[name] is not None])
        summary[f"{name}_folds"] = len(values)  # the folds with a value: both labels, or some gain to find
        summary[f"{name}_mean"] = float(values.mean()) if len(values) else None
        summary[f"{name}_std"] = float(values.std()) if len(values) else None
    log_measured = np.log([record.speedup for record in measured])
    summary["gain_log_correlation"] = float(np.corrcoef(predicted, log_measured)[0, 1]) if len(measured) > 2 else None
    summary["by_kind"] = routing_by_kind(measured, routed, predicted)
    return summary


def routing_by_kind(records: Sequence[Measurement], routed: np.ndarray, log_predicted: np.ndarray) -> dict[str, dict]:
    """Where routing wins and loses time, per kind of subtask: the oracle's saving, the classifier's, the saving
    it missed (DSpark-faster subtasks it kept on the standard pool) and the time it lost (DSpark-slower ones it
    sent there), in seconds of the standard pool's time; and the median measured and predicted speedups."""
    saved = time_saved(records)
    kinds = np.array([record.kind or "(unknown)" for record in records])
    speedups = np.array([record.speedup for record in records])
    table = {}
    for kind in sorted(set(kinds)):
        mask = kinds == kind
        gains, sent = saved[mask], routed[mask]
        table[kind] = {
            "subtasks": int(mask.sum()),
            "sent_to_dspark": int(sent.sum()),
            "dspark_faster": int((speedups[mask] > 1).sum()),
            "oracle_saved_s": oracle_saved(gains),
            "saved_s": float(gains[sent].sum()),
            "missed_s": float(gains[~sent & (gains > 0)].sum()),
            "lost_s": float(-gains[sent & (gains < 0)].sum()),
            "median_speedup": float(np.median(speedups[mask])),
            "median_predicted": float(np.exp(np.median(log_predicted[mask]))),
        }
    return table


def scoring_latency(
    classifier: DeterminismClassifier, seen: Sequence[dict], timed: Sequence[dict], calls: int
) -> dict[str, float]:
    """p50/p99 of one ``score`` call, wall clock and this thread's CPU time (what the call costs when the cores are
    shared). The tokenisation caches are warmed on ``seen`` (traffic a server would have scored before), then
    ``calls`` calls cycle through ``timed``: the first pass meets their new words cold."""
    for request in seen:
        classifier.score(request)
    wall, cpu = np.empty(calls), np.empty(calls)
    for i in range(calls):
        started, started_cpu = time.perf_counter_ns(), time.thread_time_ns()
        classifier.score(timed[i % len(timed)])
        cpu[i], wall[i] = time.thread_time_ns() - started_cpu, time.perf_counter_ns() - started
    (p50, p99), (cpu_p50, cpu_p99) = (np.percentile(times / 1000.0, [50, 99]) for times in (wall, cpu))
    return {"p50_us": float(p50), "p99_us": float(p99), "cpu_p50_us": float(cpu_p50), "cpu_p99_us": float(cpu_p99)}


def plot(scores: np.ndarray, records: Sequence[Measurement], report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from sklearn.metrics import roc_curve

    speedups = np.array([record.speedup for record in records])
    fig, (roc, scatter) = plt.subplots(1, 2, figsize=(11, 4.5))
    if report["auroc"] is not None:
        fpr, tpr, _ = roc_curve(speedups >= report["margin"], scores)
        roc.plot(fpr, tpr, label=f"AUROC {report['auroc']:.3f}")
    roc.plot([0, 1], [0, 1], linestyle=":", color="grey", label="chance")
    roc.set(xlabel="false positive rate", ylabel="true positive rate", title="ROC: speedup >= margin")
    roc.legend(loc="lower right")
    kinds = np.array([record.kind or "(unknown)" for record in records])
    for i, kind in enumerate(sorted(set(kinds))):
        mask = kinds == kind
        scatter.scatter(speedups[mask], scores[mask], s=12, label=kind, color=plt.get_cmap("tab20")(i % 20))
    scatter.axvline(report["margin"], color="grey", linestyle="--", linewidth=1)
    scatter.axhline(report["threshold"], color="grey", linestyle=":", linewidth=1)
    scatter.set(xscale="log", xlabel="measured speedup (DSpark / standard)", ylabel="score", title="score vs speedup")
    scatter.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def targets_met(report: dict[str, Any]) -> dict[str, bool]:
    """The targets are judged over the template-grouped folds where there are any (one test split of a few
    templates swings with which it drew), else on the test split; the latency on the timed calls."""
    cv = report.get("cross_validation") or {}

    def value(name: str) -> float:
        judged = cv.get(f"{name}_mean", cv.get(name)) if cv else report.get(name)
        return judged if judged is not None else -math.inf

    met = {name: value(name) >= TARGETS[name] for name in ("auroc_faster", "oracle_gain_ratio")}
    if cv:
        met["gain_log_correlation"] = value("gain_log_correlation") >= TARGETS["gain_log_correlation"]
    met["p99_us"] = report["p99_us"] <= TARGETS["p99_us"]
    return met


def _print(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"bench route: {report['subtasks']} {report['split']} subtasks, margin {report['margin']}x")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_column("target", justify="right")
    table.add_row("threshold", f"{report['threshold']:.2f}", "")
    names = ("auroc", "auroc_faster", "brier", "oracle_gain_ratio", "all_dspark_gain_ratio", "all_standard_gain_ratio")
    for name in names:
        value = report[name]
        target = TARGETS.get(name)
        table.add_row(name, "n/a" if value is None else f"{value:.3f}", f">= {target}" if target else "")
    for name in ("p50_us", "p99_us", "cpu_p50_us", "cpu_p99_us"):
        table.add_row(name, f"{report[name]:.0f}", f"<= {TARGETS[name]:.0f}" if name in TARGETS else "")
    if cv := report.get("cross_validation"):
        for name in ("auroc", "auroc_faster", "oracle_gain_ratio", "all_dspark_gain_ratio"):
            mean, std = cv[f"{name}_mean"], cv[f"{name}_std"]
            value = "n/a" if mean is None else f"{mean:.3f} ± {std:.3f} ({cv[f'{name}_folds']} folds)"
            target = TARGETS.get(name)
            table.add_row(f"{name} ({cv['folds']}-fold by template)", value, f">= {target}" if target else "")
        correlation = cv["gain_log_correlation"]
        table.add_row(
            "gain model: log correlation (out of fold)",
            "n/a" if correlation is None else f"{correlation:.3f}",
            f">= {TARGETS['gain_log_correlation']}",
        )
    Console().print(table)
    for name, title in (("online", "held-out templates"), ("new_mix", "a new request mix")):
        if replayed := report.get(name):
            Console().print(_online_table(replayed, title))
    if mix := report.get("new_mix"):
        Console().print(
            f"the new mix: DSpark faster on {mix['dspark_faster_share']:.0%}, median speedup "
            f"{mix['median_speedup']:.2f}x (the corpus carried there: {mix['corpus_dspark_faster_share']:.0%}, "
            f"{mix['corpus_median_speedup']:.2f}x)"
        )
    if ceiling := report.get("noise_ceiling"):
        Console().print(
            f"noise ceiling: {ceiling['pairs']} subtasks measured twice, log speedups correlate "
            f"{ceiling['log_correlation']:.2f}, 'faster' agrees {ceiling['faster_label_agreement']:.0%} (AUROC "
            f"{ceiling['remembered_auroc_faster']:.2f}); routing "
            f"each by its first measurement saves {ceiling['remembered_oracle_gain_ratio']:.2f} of the second's "
            f"oracle (all-DSpark {ceiling['all_dspark_gain_ratio']:.2f})"
        )
    if carried := report.get("carry_over"):
        Console().print(
            f"carried over: {carried['pairs']} subtasks remeasured on {carried['remeasured_on']}, curves scale "
            f"by {carried['carry_factor']:.2f}, mean log error {carried['mean_log_ratio_carried']:+.2f} carried "
            f"({carried['mean_log_ratio_measured']:+.2f} as measured); routing there by the carried labels saves "
            f"{carried['carried_oracle_gain_ratio']:.2f} of its oracle (as measured "
            f"{carried['measured_oracle_gain_ratio']:.2f}, all-DSpark {carried['all_dspark_gain_ratio']:.2f})"
        )
    if cv:
        Console().print(_kind_table(cv["by_kind"], cv["folds"]))


def _online_table(replayed: dict[str, Any], title: str) -> Any:
    from rich.table import Table

    def number(value: float | None, digits: int = 3) -> str:
        return "n/a" if value is None else f"{value:.{digits}f}"

    where = f", on {replayed['machine'].split('|')[0]}" if replayed.get("machine") else ""
    logged = f"{replayed['shadow']:.0%} shadow-logged, retrained every {replayed['batch']}"
    table = Table(title=f"{replayed['subtasks']} requests of {title}{where}, {logged}")
    for column in ("routed by", "to DSpark", "time / oracle", "2nd half", "oracle gain", "2nd half"):
        table.add_column(column, justify="left" if column == "routed by" else "right")
    table.add_row(
        "retrained",
        number(replayed["sent_to_dspark_mean"], 0),
        *(number(replayed[f"{name}_mean"]) for name in ("time_over_oracle", "second_half_time_over_oracle")),
        *(number(replayed[f"{name}_mean"]) for name in ("oracle_gain_ratio", "second_half_oracle_gain_ratio")),
    )
    table.add_row(
        "static",
        str(replayed["static_sent_to_dspark"]),
        number(replayed["static_time_over_oracle"]),
        number(replayed["static_second_half_time_over_oracle_mean"]),
        number(replayed["static_oracle_gain_ratio"]),
        number(replayed["static_second_half_oracle_gain_ratio_mean"]),
    )
    all_dspark = (number(replayed["all_dspark_time_over_oracle"]), "", number(replayed["all_dspark_gain_ratio"]), "")
    table.add_row("all-DSpark", str(replayed["subtasks"]), *all_dspark)
    table.add_row("all-standard", "0", number(replayed["all_standard_time_over_oracle"]), "", "0", "")
    return table


def _kind_table(by_kind: dict[str, dict], folds: int) -> Any:
    from rich.table import Table

    table = Table(title=f"where routing saves and loses ({folds}-fold by template, seconds)")
    for column in ("kind", "n", "sent", "faster", "oracle", "saved", "missed", "lost"):
        table.add_column(column, justify="left" if column == "kind" else "right")
    for kind, row in by_kind.items():
        table.add_row(
            kind,
            str(row["subtasks"]),
            str(row["sent_to_dspark"]),
            str(row["dspark_faster"]),
            *(f"{row[column]:.1f}" for column in ("oracle_saved_s", "saved_s", "missed_s", "lost_s")),
        )
    return table


def run(args: argparse.Namespace) -> int:
    from classifiers.model import DeterminismClassifier

    records, _ = read_measurements(args.measurements)
    chosen = [record for record in records if record.speedup is not None and record.resolved_split == args.split]
    if not chosen:
        raise InvalidRequestError(f"{args.measurements!r} holds no measured {args.split}-split subtasks", param="split")
    if args.latency_calls < 1:
        raise InvalidRequestError("--latency-calls must be >= 1", param="latency_calls")
    if args.threshold is not None and not 0.0 <= args.threshold <= 1.0:
        raise InvalidRequestError("--threshold must be in [0, 1]", param="threshold")
    if not 0.0 <= args.online_shadow <= 1.0 or args.online_batch < 0 or args.online_orders < 1:
        raise InvalidRequestError(
            "--online-shadow must be in [0, 1], --online-batch >= 0 and --online-orders >= 1", param="online"
        )
    if args.cv_folds == 1 or args.cv_folds < 0:
        raise InvalidRequestError("--cv-folds must be 0 (skip) or >= 2", param="cv_folds")
    classifier = DeterminismClassifier.load(args.classifier)
    seen = [record.request for record in records if record.resolved_split != args.split]
    latency = scoring_latency(classifier, seen, [record.request for record in chosen], args.latency_calls)
    scores = classifier.score_many(record.request for record in chosen)
    threshold = classifier.threshold if args.threshold is None else args.threshold
    report = {"split": args.split, **evaluate(scores, chosen, classifier.margin, threshold), **latency}
    if args.cv_folds:
        report["cross_validation"] = cross_validate(records, classifier.margin, args.threshold, args.cv_folds)
    if args.online_batch:
        fitted = [record for record in records if record.speedup is not None and record.resolved_split != args.split]
        report["online"] = online(classifier, fitted, chosen, args.online_shadow, args.online_batch, args.online_orders)
        if args.new_mix != "none" and Path(args.new_mix).is_file():
            mix, _ = read_measurements(args.new_mix)
            replay = (args.online_shadow, args.online_batch, args.online_orders)
            report["new_mix"] = new_mix(records, mix, Path(args.profiles), classifier.margin, *replay)
    if args.retest != "none" and Path(args.retest).is_file():
        report["noise_ceiling"] = noise_ceiling(records, read_measurements(args.retest)[0])
    if args.carry_over != "none" and Path(args.carry_over).is_file():
        elsewhere = read_measurements(args.carry_over)[0]
        report["carry_over"] = carry_over(records, elsewhere, Path(args.profiles))
    report["targets_met"] = targets_met(report)
    _print(report)
    write_json(args.json, report)
    if args.plot:
        plot(scores, chosen, report, args.plot)
    return 0

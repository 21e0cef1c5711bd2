"""The PNGs of ``bench fleet --plots DIR``, drawn from the JSON report alone (so a saved report redraws).

``latency_vs_rate.png``: mean, p95 and p99 subtask latency against the offered rate, a line per policy;
``throughput_vs_rate.png``: subtasks answered per second against offered; ``oracle_share.png``: ``threshold``'s
and ``time_saved``'s mean latency over the oracle's, and the share of the oracle's saving over all-standard
each gets, by load;
``reality.png``: simulated against measured mean latency at ``bench workload``'s scale, with the 20% band.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

SHARE_FLOOR = -2.0


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)


def draw_all(report: dict, folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    drawings = {
        "latency_vs_rate.png": latency_vs_rate,
        "throughput_vs_rate.png": throughput_vs_rate,
        "oracle_share.png": oracle_share,
    }
    if report.get("reality"):
        drawings["reality.png"] = reality
    for name, draw in drawings.items():
        draw(report, folder / name)
    return [folder / name for name in drawings]


def _offered(report: dict) -> list[float]:
    return [report["offered_subtasks_per_s"][load] for load in report["loads"]]


def _series(report: dict, policy: str, key: str) -> list[float]:
    values = [report["results"][policy][load][key] for load in report["loads"]]
    return [np.nan if value is None else value for value in values]


def _saturation(axis, report: dict) -> None:
    axis.axvline(report["capacity_subtasks_per_s"], color="grey", linestyle=":", linewidth=1)


def latency_vs_rate(report: dict, path: Path) -> None:
    plt = _pyplot()
    offered = _offered(report)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    titles = {"mean_latency_s": "mean", "p95_latency_s": "p95", "p99_latency_s": "p99"}
    for axis, (key, title) in zip(axes, titles.items()):
        for policy in report["policies"]:
            axis.plot(offered, _series(report, policy, key), marker="o", label=policy)
        _saturation(axis, report)
        axis.set(xlabel="offered subtasks/s", ylabel="seconds", title=f"{title} subtask latency", yscale="log")
    axes[0].legend(fontsize=8)
    fig.suptitle(
        f"{report['fleet']['workers']:,} workers of {report['profile']['name']}; dotted: all-standard capacity"
    )
    _save(fig, path)


def throughput_vs_rate(report: dict, path: Path) -> None:
    plt = _pyplot()
    offered = _offered(report)
    fig, axis = plt.subplots(figsize=(6.5, 4.5))
    for policy in report["policies"]:
        axis.plot(offered, _series(report, policy, "subtasks_per_s"), marker="o", label=policy)
    axis.plot(offered, offered, color="grey", linestyle=":", linewidth=1, label="offered")
    _saturation(axis, report)
    axis.set(xlabel="offered subtasks/s", ylabel="answered subtasks/s", title="throughput against offered load")
    axis.legend(fontsize=8)
    _save(fig, path)


def oracle_share(report: dict, path: Path) -> None:
    """Mean latency over the oracle's (the target: at most 1.1), and the time saved against all-standard as a
    share of the oracle's saving (clipped: where the oracle saves little, a small loss is a large share)."""
    plt = _pyplot()
    by_load = report["comparison"]["by_load"]
    loads = [load for load in report["loads"] if load in by_load]
    x = [float(load) for load in loads]
    fig, (ratio, share) = plt.subplots(1, 2, figsize=(11, 4.2))
    for policy in ("threshold", "time_saved"):
        ratios = [by_load[load].get(f"{policy}_over_oracle") for load in loads]
        shares = [by_load[load].get(f"{policy}_oracle_share") for load in loads]
        ratio.plot(x, [np.nan if r is None else r for r in ratios], marker="o", label=policy)
        share.plot(x, [np.nan if s is None else max(s, SHARE_FLOOR) for s in shares], marker="o", label=policy)
    ratio.axhline(1.1, color="grey", linestyle=":", linewidth=1, label="target")
    ratio.set(xlabel="load (offered / all-standard capacity)", ylabel="mean latency / oracle's", yscale="log")
    ratio.set_title("mean latency over the oracle's")
    share.axhline(1.0, color="grey", linestyle=":", linewidth=1)
    share.axhline(0.0, color="grey", linewidth=0.5)
    share.set(xlabel="load (offered / all-standard capacity)", ylabel=f"share (floor {SHARE_FLOOR:.0%})")
    share.set_title("time saved over all-standard / the oracle's")
    ratio.legend(fontsize=8)
    _save(fig, path)


def reality(report: dict, path: Path) -> None:
    plt = _pyplot()
    rows = report["reality"]["rows"]
    fig, axis = plt.subplots(figsize=(5.5, 5))
    for policy in report["reality"]["policies"]:
        mine = [row for row in rows if row["policy"] == policy]
        axis.scatter([r["measured_mean_s"] for r in mine], [r["simulated_mean_s"] for r in mine], label=policy)
    values = [v for row in rows for v in (row["measured_mean_s"], row["simulated_mean_s"])]
    line = np.linspace(min(values) * 0.8, max(values) * 1.2, 2)
    band = report["reality"]["target"]
    axis.plot(line, line, color="grey", linewidth=1)
    axis.fill_between(line, line * (1 - band), line * (1 + band), color="grey", alpha=0.15, label=f"±{band:.0%}")
    axis.set(
        xlabel="measured mean latency, s (bench workload)",
        ylabel="simulated mean latency, s",
        title=f"simulator at {report['reality']['workers']} workers",
    )
    axis.legend(fontsize=8)
    _save(fig, path)

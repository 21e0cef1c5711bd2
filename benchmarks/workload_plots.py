"""The PNGs of ``bench workload --plots DIR``, drawn from the JSON report alone (so a saved report redraws).

``latency_vs_rate.png``: mean and p95 latency against arrival rate, a line per policy;
``throughput_vs_speed.png``: total tokens/s against per-request tokens/s, a point per rate (the batching
trade-off each policy makes); ``speedup_by_group.png``: measured and predicted solo speedup by subtask kind
and real-prompt set; ``predicted_vs_measured.png``: the expected-gain model against each request's measured
speedup; ``dspark_share.png``: the share each routed policy sends to DSpark against the arrival rate and against
the DSpark pool's occupancy when the request arrived.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

OCCUPANCY_BINS = (0.0, 0.125, 0.25, 0.5, 0.75, 1.0, np.inf)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw_all(report: dict, folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    drawings = {
        "latency_vs_rate.png": latency_vs_rate,
        "throughput_vs_speed.png": throughput_vs_speed,
        "speedup_by_group.png": speedup_by_group,
        "predicted_vs_measured.png": predicted_vs_measured,
        "dspark_share.png": dspark_share,
    }
    written = []
    for name, draw in drawings.items():
        draw(report, folder / name)
        written.append(folder / name)
    return written


def _series(report: dict, policy: str, key: str) -> list[float]:
    return [report["results"][policy][rate][key] or np.nan for rate in report["rates"]]


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)


def latency_vs_rate(report: dict, path: Path) -> None:
    plt = _pyplot()
    rates = [float(rate) for rate in report["rates"]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for axis, key, title in zip(axes, ("mean_latency_s", "p95_latency_s"), ("mean latency", "p95 latency")):
        for policy in report["policies"]:
            axis.plot(rates, _series(report, policy, key), marker="o", label=policy)
        axis.set(xlabel="arrival rate, requests/s", ylabel="seconds", title=title, yscale="log")
    axes[0].legend(fontsize=8)
    _save(fig, path)


def throughput_vs_speed(report: dict, path: Path) -> None:
    plt = _pyplot()
    fig, axis = plt.subplots(figsize=(6.5, 4.5))
    for policy in report["policies"]:
        axis.plot(
            _series(report, policy, "per_request_tokens_per_s"),
            _series(report, policy, "tokens_per_s"),
            marker="o",
            label=policy,
        )
    axis.set(xlabel="per-request tokens/s", ylabel="total tokens/s", title="throughput against per-request speed")
    axis.legend(fontsize=8)
    _save(fig, path)


def speedup_by_group(report: dict, path: Path) -> None:
    plt = _pyplot()
    groups = report["speedup_by_group"]
    names = list(groups)
    xs = np.arange(len(names))
    fig, axis = plt.subplots(figsize=(max(6.0, 0.7 * len(names)), 4.5))
    axis.bar(xs - 0.2, [groups[n]["median_speedup"] for n in names], 0.4, label="measured (median)")
    axis.bar(xs + 0.2, [groups[n]["median_predicted"] for n in names], 0.4, label="predicted (median)")
    axis.axhline(1.0, color="grey", linestyle=":", linewidth=1)
    axis.set_xticks(xs, [f"{n}{' *' if groups[n]['source'] == 'prompt' else ''}" for n in names], rotation=40)
    axis.set(ylabel="solo DSpark speedup", title="speedup by subtask kind and real-prompt set (*)")
    axis.legend(fontsize=8)
    _save(fig, path)


def predicted_vs_measured(report: dict, path: Path) -> None:
    plt = _pyplot()
    fig, axis = plt.subplots(figsize=(5.5, 5))
    for source, marker in (("subtask", "o"), ("prompt", "^")):
        items = [item for item in report["items"] if item["source"] == source]
        if items:
            axis.scatter(
                [i["speedup"] for i in items], [i["predicted"] for i in items], s=14, marker=marker, label=source
            )
    values = [v for item in report["items"] for v in (item["speedup"], item["predicted"])]
    low, high = min(values) * 0.9, max(values) * 1.1
    axis.plot([low, high], [low, high], color="grey", linestyle=":", linewidth=1)
    correlation = report["prediction"]["log_correlation"]
    title = "expected-gain model" + (f" (log r = {correlation:.2f})" if correlation is not None else "")
    axis.set(xscale="log", yscale="log", xlabel="measured solo speedup", ylabel="predicted", title=title)
    axis.legend(fontsize=8)
    _save(fig, path)


def dspark_share(report: dict, path: Path) -> None:
    plt = _pyplot()
    rates = [float(rate) for rate in report["rates"]]
    routed = list(report["dspark_share_by_occupancy"])
    fig, (by_rate, by_load) = plt.subplots(1, 2, figsize=(11, 4.2))
    for policy in routed:
        by_rate.plot(rates, _series(report, policy, "dspark_share"), marker="o", label=policy)
        pairs = np.array(report["dspark_share_by_occupancy"][policy], dtype=float)
        bins = np.digitize(pairs[:, 0], OCCUPANCY_BINS[1:-1])
        centres, shares = [], []
        for b in sorted(set(bins.tolist())):
            chosen = pairs[bins == b]
            centres.append(float(np.mean(chosen[:, 0])))
            shares.append(float(np.mean(chosen[:, 1])))
        by_load.plot(centres, shares, marker="o", label=policy)
    by_rate.set(xlabel="arrival rate, requests/s", ylabel="share sent to DSpark", title="share to DSpark vs rate")
    by_load.set(
        xlabel="DSpark pool depth / slots at arrival", ylabel="share sent to DSpark", title="share to DSpark vs load"
    )
    for axis in (by_rate, by_load):
        axis.set_ylim(-0.05, 1.05)
    by_rate.legend(fontsize=8)
    _save(fig, path)

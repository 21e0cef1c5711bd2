"""What ``bench soak`` reports from its outcomes and memory samples: the JSON, the 80-column summary and the plot
over time."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.output import wrapped
from benchmarks.pools import percentile
from benchmarks.soak_clients import Outcome

TARGETS = {"lost": 0, "duplicated": 0, "server_errors": 0, "rss_growth": 0.10, "p99_drift": 0.20}
"""The soak's benchmark targets (not the test's): 0 lost, 0 duplicated, no 5xx but typed 503s, RSS growth under
10% after the warm-up window, last window's p99 within 20% of the first's."""


def _percentile(values: list[float], q: float) -> float | None:
    """``bench pools``' percentile, None for a window with no answers."""
    return percentile(values, q) if values else None


def _timed(outcomes: list[Outcome]) -> list[Outcome]:
    """Whole answers only: refusals and abandoned streams have no latency that means anything."""
    return [o for o in outcomes if o.status == "200" and o.kind not in ("bad", "abandon") and o.latency_s]


def _window_p99_ms(outcomes: list[Outcome], start_s: float, end_s: float) -> float | None:
    p99 = _percentile([o.latency_s for o in _timed(outcomes) if start_s <= o.started_s < end_s], 0.99)
    return None if p99 is None else 1000 * p99


def latency_buckets(outcomes: list[Outcome], seconds: float, bucket_s: float) -> list[dict[str, Any]]:
    out = []
    for i in range(max(1, math.ceil(seconds / bucket_s))):
        inside = [o.latency_s for o in _timed(outcomes) if i * bucket_s <= o.started_s < (i + 1) * bucket_s]
        p50, p99 = _percentile(inside, 0.5), _percentile(inside, 0.99)
        out.append(
            {
                "t_s": i * bucket_s,
                "requests": len(inside),
                "p50_ms": None if p50 is None else 1000 * p50,
                "p99_ms": None if p99 is None else 1000 * p99,
            }
        )
    return out


def rss_growth(samples: list[dict[str, Any]], after_s: float) -> dict[str, float]:
    """Each process's RSS in the last sample over its RSS ``after_s`` after it first appeared (so the replacement
    worker and the restarted Redis get a warm-up of their own), minus one; processes gone by the end (the killed
    worker, the stopped Redis) or too young for a warm-up drop out."""
    if not samples:
        return {}
    growth = {}
    for label, last in samples[-1]["rss_mb"].items():
        born = next(s["t_s"] for s in samples if label in s["rss_mb"])
        warm = [s["rss_mb"][label] for s in samples if label in s["rss_mb"] and s["t_s"] >= born + after_s]
        if len(warm) > 1:
            growth[label] = last / warm[0] - 1
    return growth


def cache_peaks(samples: list[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """Each of the gateway's caches (``pool/cache``): the most it held in MB over the soak, and in the last sample
    that reached the gateway."""
    seen = [s["cache_mb"] for s in samples if s.get("cache_mb")]
    names = {name for held in seen for name in held}
    return {name: (max(held.get(name, 0.0) for held in seen), seen[-1].get(name, 0.0)) for name in names}


def build(
    outcomes: list[Outcome], samples: list[dict[str, Any]], faults: list[dict[str, Any]], run: dict[str, Any]
) -> dict[str, Any]:
    """``run``: the settings and capacity measured; the rest is computed here."""
    seconds, bucket_s = run["seconds"], run["bucket_s"]
    warmup_s, window_s = min(300.0, seconds / 4), min(600.0, seconds / 4)
    first = _window_p99_ms(outcomes, 0, window_s)
    last = _window_p99_ms(outcomes, seconds - window_s, seconds)
    growth = rss_growth(samples, warmup_s)
    report = {
        **run,
        "requests": len(outcomes),
        "by_kind": dict(Counter(o.kind for o in outcomes)),
        "errors_by_status": dict(Counter(o.status for o in outcomes if o.status != "200")),
        "lost": sum(o.lost for o in outcomes),
        "duplicated": sum(o.duplicated for o in outcomes),
        "server_errors": sum(o.server_error for o in outcomes),
        "faults": faults,
        "latency": latency_buckets(outcomes, seconds, bucket_s),
        "rss": samples,
        "rss_growth_after_s": warmup_s,
        "rss_growth": growth,
        "p99_window_s": window_s,
        "p99_first_ms": first,
        "p99_last_ms": last,
        "p99_drift": None if not first or last is None else last / first - 1,
        "targets": TARGETS,
        "examples": [asdict(o) for o in outcomes if o.lost or o.duplicated or o.server_error][:20],
    }
    report["met"] = {
        "lost": report["lost"] == 0,
        "duplicated": report["duplicated"] == 0,
        "server_errors": report["server_errors"] == 0,
        "rss_growth": all(g < TARGETS["rss_growth"] for g in growth.values()),
        "p99_drift": report["p99_drift"] is not None and abs(report["p99_drift"]) <= TARGETS["p99_drift"],
    }
    return report


def show(report: dict[str, Any]) -> None:
    """The summary, each line within 80 columns."""
    print(f"model: {report['model']}")
    print(
        f"capacity {report['capacity_rps']:.1f} req/s closed loop; driven at {report['rate_rps']:.1f} req/s "
        f"for {report['seconds'] / 60:g} min"
    )
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(report["by_kind"].items()))
    print(wrapped(f"requests {report['requests']}: {kinds}"))
    errors = ", ".join(f"{k} x{n}" for k, n in sorted(report["errors_by_status"].items()))
    print(wrapped(f"not 200: {errors or 'none'}"))
    print(f"lost {report['lost']}, duplicated {report['duplicated']}, 5xx but 503 {report['server_errors']}")
    print("faults: " + ", ".join(f"{f['fault']} at {f['at_s']:.0f}s" for f in report["faults"]))
    print(f"p50/p99 per {report['bucket_s']:g}-second bucket (ms):")
    for b in report["latency"]:
        p50, p99 = b["p50_ms"], b["p99_ms"]
        cells = "no answers" if p50 is None else f"p50 {p50:7.1f}  p99 {p99:7.1f}"
        print(f"  {b['t_s']:6.0f}s  {b['requests']:5d} answers  {cells}")
    growth = ", ".join(f"{k} {100 * g:+.1f}%" for k, g in sorted(report["rss_growth"].items()))
    print(wrapped(f"RSS growth after {report['rss_growth_after_s']:.0f}s: {growth}"))
    caches = cache_peaks(report["rss"])
    if caches:
        held = ", ".join(f"{name} {peak:.2f} MB (last {last:.2f})" for name, (peak, last) in sorted(caches.items()))
        print(wrapped(f"gateway caches, most held: {held}"))
    drift = report["p99_drift"]
    print(f"p99 last vs first {report['p99_window_s']:.0f}s: " + ("n/a" if drift is None else f"{100 * drift:+.1f}%"))
    died = [f"{label} ({code})" for label, code in report["exit_codes"].items() if code not in (None, -9)]
    print(f"died unasked: {', '.join(died) or 'none'}")
    missed = [name for name, met in report["met"].items() if not met]
    print("targets: all met" if not missed else f"targets missed: {', '.join(missed)}")


def plot(report: dict[str, Any], path: Path) -> Path:
    """Latency per bucket above, each process's RSS below, the faults marked on both."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    buckets = [b for b in report["latency"] if b["p50_ms"] is not None]
    for level in ("p50", "p99"):
        top.plot([b["t_s"] for b in buckets], [b[f"{level}_ms"] for b in buckets], marker="o", label=level)
    top.set_ylabel("latency, ms")
    top.set_title(f"soak at {report['rate_rps']:.1f} req/s ({report['bucket_s']:g}-second buckets)")
    labels = sorted({label for s in report["rss"] for label in s["rss_mb"]})
    for label in labels:
        points = [(s["t_s"], s["rss_mb"][label]) for s in report["rss"] if label in s["rss_mb"]]
        bottom.plot([t for t, _ in points], [m for _, m in points], label=label)
    bottom.set_ylabel("RSS, MiB")
    bottom.set_xlabel("seconds into the run")
    for axis in (top, bottom):
        for fault in report["faults"]:
            axis.axvline(fault["at_s"], color="tab:red", linestyle="--", linewidth=1)
        axis.legend(fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

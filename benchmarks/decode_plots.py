"""The PNGs of ``bench decode --plots DIR``, drawn from the JSON report alone (so a saved report redraws).

``tokens_per_s.png``: every contender by prompt set; ``acceptance_by_position.png``: conditional acceptance
by block position as decoding met it (the DSpark paper's Figure 2); ``threshold_sweep.png``: acceptance rate
and accepted length against a static confidence threshold (its Figure 5); ``reliability.png``: the published
drafter's predicted prefix survival against what survived, before and after calibration (its Figure 6).
"""

from __future__ import annotations

from pathlib import Path

BAR_CONTENDERS = ("ar", "hf_greedy", "hf_prompt_lookup", "hf_assisted")
LABELS = {
    "ar": "own AR",
    "hf_greedy": "HF greedy",
    "hf_prompt_lookup": "HF prompt lookup",
    "hf_assisted": "HF assisted",
}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw_all(report: dict, folder: Path) -> list[Path]:
    """Every plot the report has data for; returns the files written."""
    folder.mkdir(parents=True, exist_ok=True)
    written = [tokens_per_s(report, folder / "tokens_per_s.png")]
    written.append(acceptance_by_position(report, folder / "acceptance_by_position.png"))
    if report["probe"]:
        written.append(threshold_sweep(report, folder / "threshold_sweep.png"))
    if any(entry.get("reliability") for entry in report["probe"].values()):
        written.append(reliability(report, folder / "reliability.png"))
    return written


def tokens_per_s(report: dict, path: Path) -> Path:
    plt = _pyplot()
    sets = list(report["sets"])
    keys = [c for c in (*BAR_CONTENDERS, *(f"dspark_{d}" for d in report["drafters"])) if c in report["contenders"]]
    fig, ax = plt.subplots(figsize=(max(8.0, 1.2 * len(sets)), 4.5))
    width = 0.8 / len(keys)
    for i, key in enumerate(keys):
        values = [report["sets"][s]["tokens_per_s"].get(key) or 0.0 for s in sets]
        label = LABELS.get(key) or f"DSpark ({key.removeprefix('dspark_')})"
        ax.bar([x + i * width for x in range(len(sets))], values, width, label=label)
    ax.set_xticks([x + width * (len(keys) - 1) / 2 for x in range(len(sets))], sets, rotation=30, ha="right")
    ax.set_ylabel("tokens / s")
    ax.set_title(f"bench decode: {Path(report['model']).name}, {report['max_tokens']} tokens a prompt")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def base_name(name: str) -> str:
    """``humaneval_t1`` and ``prose_t0.8`` share their greedy set's colour."""
    return name.split("_t")[0]


def acceptance_by_position(report: dict, path: Path) -> Path:
    """One panel per drafter (columns) and temperature kind (rows: greedy, sampled), one line per set."""
    plt = _pyplot()
    drafters, sets = report["drafters"], report["sets"]
    kinds = [k for k in ("greedy", "sampled") if any((e["temperature"] == 0) == (k == "greedy") for e in sets.values())]
    colours = {name: plt.cm.tab10(i % 10) for i, name in enumerate(dict.fromkeys(map(base_name, sets)))}
    fig, axes = plt.subplots(len(kinds), len(drafters), figsize=(5.5 * len(drafters), 3.8 * len(kinds)), squeeze=False)
    for row, kind in zip(axes, kinds):
        for ax, drafter in zip(row, drafters):
            for name, entry in sets.items():
                points = [(k + 1, v) for k, v in enumerate(entry["drafters"][drafter]["conditional_acceptance"])]
                points = [p for p in points if p[1] is not None]
                if points and (entry["temperature"] == 0) == (kind == "greedy"):
                    ax.plot(*zip(*points), marker="o", markersize=3, color=colours[base_name(name)], label=name)
            ax.set_ylim(0, 1.02)
            ax.xaxis.get_major_locator().set_params(integer=True)
            ax.set_xlabel("draft position k")
            ax.set_ylabel("P(accept k | 1..k-1 accepted)")
            ax.set_title(f"drafter: {drafter}, {kind}")
            if ax.lines:
                ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def threshold_sweep(report: dict, path: Path) -> Path:
    """Greedy prompts pooled, from the teacher-forced probe."""
    plt = _pyplot()
    fig, (rate_ax, length_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for drafter, entry in report["probe"].items():
        sweep = entry["threshold_sweep"]
        rates = [(p["threshold"], p["acceptance_rate"]) for p in sweep if p["acceptance_rate"] is not None]
        if rates:
            rate_ax.plot(*zip(*rates), marker="o", markersize=3, label=drafter)
        length_ax.plot([p["threshold"] for p in sweep], [p["mean_accepted"] for p in sweep], marker="o", label=drafter)
    rate_ax.set_ylim(0, 1.02)
    rate_ax.set_xlabel("static confidence threshold")
    rate_ax.set_ylabel("verified draft tokens accepted")
    length_ax.set_xlabel("static confidence threshold")
    length_ax.set_ylabel("mean accepted length per round")
    for ax in (rate_ax, length_ax):
        ax.set_xlim(-0.02, 1.0)
        ax.legend()
    fig.suptitle("acceptance against a static threshold (greedy, teacher-forced)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def reliability(report: dict, path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], ":", color="grey", label="perfect")
    for drafter, entry in report["probe"].items():
        for stage, table in (entry.get("reliability") or {}).items():
            points = [(b["predicted"], b["observed"]) for b in table["bins"]]
            label = f"{drafter} {stage} (ECE {table['ece']:.3f})"
            ax.plot(*zip(*points), marker="o", label=label)
    ax.set_xlabel("predicted prefix survival")
    ax.set_ylabel("observed survival (greedy)")
    ax.set_title("confidence reliability")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

"""What a forward pass costs on the simulated fleet's workers: the cost curves ``bench fleet`` runs on.

A profile is a JSON file in ``benchmarks/fleet_profiles/`` (or any path) that gives, each with its source, the
target's steps per second by forward length, the tokens a DSpark row feeds each forward (``verify_tokens``), the
drafter's cost outside the forward (``draft_s``), what each row of a batch adds outside the curve (``*_row_s``)
and the batch a worker decodes (``max_batch``). The curve is
one of the project's own measured curves (``dspark_sps.json``, by machine key), a measured table, or a roofline of
published figures (a card's memory bandwidth and matrix throughput, a model's size), with every input's source.

Costs follow the router's own model (:mod:`router.expected_time`): a standard row advances one token per
forward of ``rows`` tokens, a DSpark round of ``rows`` rows costs a forward of ``rows * verify_tokens`` tokens
plus ``rows * draft_s``, and each row beyond the first adds its per-row cost. On the project's CPU that last
term is most of a full batch's cost (``bench batching`` measured 16 rows at half the throughput the curve alone
predicts); the simulated pools' configs carry it (``load.row_s``), as an operator would set it from that
benchmark, so the policy knows the costs it is judged on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends.default_model import REPO_ROOT
from backends.dspark.curves import closest_curve, stored_curves
from backends.scheduling import SpsCurve

PROFILES_DIR = Path(__file__).with_name("fleet_profiles")
DEFAULT_PROFILE = "cpu-epyc-zen4"
ROOFLINE_SHORT = 16
"""Every forward length up to this is tabulated, then a grid growing by half (as the project's profiler does)."""


@dataclass(frozen=True)
class CostProfile:
    """One kind of worker: its curve (made monotone, as the router makes it) and its DSpark settings."""

    name: str
    description: str
    curve: SpsCurve
    verify_tokens: float
    draft_s: float
    max_batch: int
    standard_row_s: float
    dspark_row_s: float
    """What each row beyond the first adds to a forward outside the curve (sampling, bookkeeping, padding),
    measured on batched engines: a curve of one row of n tokens does not see it."""

    def step_s(self, rows: int, dspark: bool) -> float:
        """Seconds of one forward of ``rows`` rows: the round cost of
        :func:`~backends.scheduling.scaled_speedup` (the policy's own model), per-row cost included."""
        if not dspark:
            return 1.0 / self.curve.at(rows) + (rows - 1) * self.standard_row_s
        forward = 1.0 / self.curve.at(max(rows, round(rows * self.verify_tokens)))
        return forward + rows * self.draft_s + (rows - 1) * self.dspark_row_s

    def tokens_per_round(self, solo_speedup: float) -> float:
        """Tokens a lone DSpark row commits per round for this solo speedup: the round costs ``step_s(1, True)``
        and the row must finish ``solo_speedup`` times sooner than one token per ``step_s(1, False)``."""
        return solo_speedup * self.step_s(1, True) / self.step_s(1, False)

    def sps_file(self, folder: Path) -> Path:
        """The curve in ``dspark_sps.json``'s layout, for the simulated pools' ``load.profile``: the router reads
        its cost model from the same numbers the simulation runs on."""
        path = folder / "dspark_sps.json"
        path.write_text(json.dumps({self.name: {str(n): rate for n, rate in self.curve.steps_per_s.items()}}))
        return path


def bundled() -> list[str]:
    return sorted(path.stem for path in PROFILES_DIR.glob("*.json"))


def load_profile(spec: str | Path) -> CostProfile:
    """A bundled profile by name, or a profile file by path."""
    path = Path(spec)
    if not path.is_file():
        path = PROFILES_DIR / f"{spec}.json"
    if not path.is_file():
        raise FileNotFoundError(f"no fleet profile {str(spec)!r} (bundled: {', '.join(bundled())})")
    data = json.loads(path.read_text())
    return CostProfile(
        name=data["name"],
        description=data["description"],
        curve=_curve(data["curve"]).monotone(),
        verify_tokens=float(_value(data["verify_tokens"])),
        draft_s=float(_value(data["draft_s"])),
        max_batch=int(_value(data["max_batch"])),
        standard_row_s=float(_value(data["standard_row_s"])),
        dspark_row_s=float(_value(data["dspark_row_s"])),
    )


def _value(entry: dict[str, Any]) -> float:
    """A number of the file, which must say where it comes from."""
    if not entry.get("source"):
        raise ValueError(f"a profile number without a source: {entry}")
    return entry["value"]


def _curve(spec: dict[str, Any]) -> SpsCurve:
    if spec["kind"] == "sps_file":
        stored = closest_curve(stored_curves(REPO_ROOT / spec["file"]), spec["machine"])
        if stored is None:
            raise ValueError(f"{spec['file']} holds no curve")
        return SpsCurve.from_stored(stored)
    if spec["kind"] == "table":
        _value({"value": spec["steps_per_s"], "source": spec.get("source")})
        return SpsCurve.from_stored(spec["steps_per_s"])
    if spec["kind"] == "roofline":
        return roofline({name: float(_value(entry)) for name, entry in spec["inputs"].items()})
    raise ValueError(f"unknown curve kind {spec['kind']!r}")


def roofline(inputs: dict[str, float]) -> SpsCurve:
    """Steps per second of a forward of n tokens: a fixed overhead plus reading the weights once and doing the
    matrix work of n tokens, each at its stated efficiency, blended as the p-norm of the two times (p = ``blend``:
    a sharp max() would put the knee where a real card is already slowing). Attention over the context is left
    out (for short agent subtasks on an 8B model with grouped-query attention it is a small share of the bytes)."""
    read_s = inputs["weight_bytes"] / (inputs["memory_bytes_per_s"] * inputs["bandwidth_efficiency"])
    token_s = inputs["flops_per_token"] / (inputs["matmul_flops_per_s"] * inputs["compute_efficiency"])
    p = inputs["blend"]
    lengths = list(range(1, ROOFLINE_SHORT + 1))
    while lengths[-1] < inputs["max_tokens"]:
        lengths.append(min(int(inputs["max_tokens"]), int(lengths[-1] * 1.5)))
    return SpsCurve({n: 1.0 / (inputs["overhead_s"] + (read_s**p + (n * token_s) ** p) ** (1 / p)) for n in lengths})

"""The policies ``bench workload`` compares, each a real :class:`~router.Router` over in-process pools with the same
capacity: two workers, either one DSpark and one standard (the routed policies) or two of one kind.

* ``all_standard`` / ``all_dspark``: one pool of two workers, everything goes there;
* ``random``: half and half, by the policy's own seeded explore share (0.5);
* ``rules``: the embedded default config's rules, else the standard pool;
* ``classifier``: the determinism classifier's score against its fixed calibrated threshold (or ``--threshold``);
* ``time_saved``: the expected-gain model's speedup weighed against both pools' load (``policy.objective``);
* ``oracle``: the same load-aware estimator fed each request's measured solo speedup instead of a prediction.

The classifier, time-saved and oracle policies run without rules, so each shows its own decisions.

Equal capacity, which :func:`capacity` states per policy and the report prints: two in-process workers of
``max_batch`` slots each, the same model and cost profile, and one torch thread per worker (``bench workload``
sets it), so every policy has the same two cores, weights and batch room, and differs only in which decode loop
each worker runs and which requests it gets.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from router import Router
from router.config import load_config, parse_config

POLICIES = ("all_standard", "all_dspark", "random", "rules", "classifier", "time_saved", "oracle")
SINGLE_POOL = {"all_standard": "standard", "all_dspark": "dspark"}
CLASSIFIED = ("classifier", "time_saved", "oracle")
MAX_QUEUE = 4096
TIMEOUT_S = 600.0


class OracleScorer:
    """Knows every workload request's measured solo speedup (by ``metadata.item``): what a perfect expected-gain
    model would predict. It has no probability to score with, so it serves ``time_saved`` only."""

    predicts_speedup = True

    def __init__(self, speedups: Mapping[str, float]) -> None:
        self.speedups = dict(speedups)

    def expected_speedup(self, request: dict[str, Any]) -> float:
        return self.speedups[request["metadata"]["item"]]

    def score(self, request: dict[str, Any]) -> float:
        return float(self.expected_speedup(request) > 1.0)


def _pool(backend: str, model: Path, workers: int, max_batch: int, profile: Path | None) -> dict[str, Any]:
    return {
        "backend": backend,
        "model": str(model),
        "workers": workers,
        "max_batch": max_batch,
        "max_queue": MAX_QUEUE,
        "timeout_s": TIMEOUT_S,
        "load": {"profile": str(profile) if profile is not None else None},
    }


def policy_config(name: str, model: Path, max_batch: int, profile: Path | None, seed: int) -> dict[str, Any]:
    """The router config of one policy: its pools (equal capacity) and its policy section."""
    if name in SINGLE_POOL:
        pool = SINGLE_POOL[name]
        backend = "dspark" if pool == "dspark" else "autoregressive"
        pools = {pool: _pool(backend, model, 2, max_batch, profile)}
        return {"pools": pools, "policy": {"classifier": None, "default_pool": pool, "seed": seed}}
    pools = {
        "dspark": _pool("dspark", model, 1, max_batch, profile),
        "standard": _pool("autoregressive", model, 1, max_batch, profile),
    }
    policy: dict[str, Any] = {"classifier": None, "default_pool": "standard", "seed": seed}
    if name == "random":
        policy["explore"] = 0.5
    elif name == "rules":
        policy["rules"] = [rule.model_dump(exclude_none=True) for rule in load_config(check_paths=False).policy.rules]
    elif name in CLASSIFIED:
        policy["classifier"] = "default"  # replaced by the scorer the router is given
        policy["objective"] = "threshold" if name == "classifier" else "time_saved"
    return {"pools": pools, "policy": policy}


def capacity(config: dict[str, Any]) -> dict[str, Any]:
    """What a policy's pools can serve at once: workers, batch slots in all, and the models they load."""
    pools = config["pools"].values()
    return {
        "workers": sum(pool["workers"] for pool in pools),
        "slots": sum(pool["workers"] * pool["max_batch"] for pool in pools),
        "models": sorted({pool["model"] for pool in pools}),
    }


def build_router(
    name: str,
    model: Path,
    max_batch: int,
    profile: Path | None,
    seed: int,
    classifier: Any,
    oracle: OracleScorer,
    threshold: float | None,
) -> Router:
    data = policy_config(name, model, max_batch, profile, seed)
    if name == "classifier" and threshold is not None:
        data["policy"]["threshold"] = threshold
    scorer = oracle if name == "oracle" else classifier if name in CLASSIFIED else None
    return Router(parse_config(data, base_dir=model), scorer=scorer)

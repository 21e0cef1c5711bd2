"""The routers ``bench fleet`` judges: the shipped policy code, built as :class:`~router.sdk.Router` builds it,
over simulated pools instead of real ones.

``Router`` makes ``Policy(config.policy, scorer, LoadEstimator.for_pools(config, loads))``, where ``loads`` reads
each pool's counters; here ``loads`` reads a :class:`~benchmarks.fleet_sim.SimPool`'s, and every subtask's
request goes through :meth:`~router.policy.Policy.decide` as the router parses it (rules, tenant overrides,
hints, the threshold or ``time_saved`` objective, exploration). The one shortcut is the classifier's scoring:
a request's features do not depend on load, so each distinct request is scored once, in a batch, by the real
classifier (:class:`Prescored`), and a million arrivals read those numbers instead of repeating them.

The policies, at equal capacity (``workers`` in all; the routed ones split them between the two pools):

* ``all_standard`` / ``all_dspark``: one pool of every worker;
* ``threshold``: the config's policy with ``objective: threshold`` (the classifier's score against its threshold);
* ``time_saved``: the config's policy with ``objective: time_saved`` (expected speedup against both pools' load);
* ``oracle``: ``time_saved``'s estimator fed each request's measured speedup, without rules or exploration.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from backends.scheduling import SpsCurve, scaled_speedup
from benchmarks.fleet_profiles import CostProfile
from benchmarks.fleet_sim import Decide, FleetSim, PoolSpec, SimPool, SimResult
from benchmarks.fleet_trace import Items, Trace
from benchmarks.workload_policies import OracleScorer
from router.config import PolicyConfig, RouterConfig, parse_config
from router.expected_time import LoadEstimator
from router.policy import Policy
from router.request import RoutedRequest, parse_openai_args

POLICIES = ("all_standard", "all_dspark", "threshold", "time_saved", "oracle")
SINGLE_POOL = {"all_standard": False, "all_dspark": True}
ITEM_KEY = "item"
"""The key of ``metadata`` that names a request's item, for the scorers (rules never read it)."""


class Prescored:
    """A classifier's answers for every item, computed up front in one batch by the classifier itself (its
    Pipeline, which gives the numbers of its one-request path): what the policy asks of a scorer, by item."""

    predicts_speedup = True

    def __init__(
        self, scores: Sequence[float], speedups: Sequence[float], threshold: float, curve: SpsCurve | None
    ) -> None:
        self._scores, self._speedups = list(scores), list(speedups)
        self.threshold = threshold
        self.calibration_curve = curve

    @classmethod
    def of(cls, classifier: Any, bodies: Sequence[dict[str, Any]]) -> Prescored:
        return cls(
            classifier.score_many(bodies).tolist(),
            classifier.expected_speedup_many(bodies).tolist(),
            classifier.threshold,
            classifier.calibration_curve,
        )

    def score(self, request: dict[str, Any]) -> float:
        return self._scores[request["metadata"][ITEM_KEY]]

    def expected_speedup(self, request: dict[str, Any]) -> float:
        return self._speedups[request["metadata"][ITEM_KEY]]


@dataclass(frozen=True)
class Fleet:
    """The simulated machines: how many workers, of which profile, split how, with what queues."""

    profile: CostProfile
    workers: int
    dspark_share: float
    max_queue: int

    def specs(self, policy: str, dspark_pool: str, standard_pool: str) -> list[PoolSpec]:
        batch = self.profile.max_batch
        if policy in SINGLE_POOL:
            dspark = SINGLE_POOL[policy]
            name = dspark_pool if dspark else standard_pool
            return [PoolSpec(name, dspark, self.workers, batch, self.max_queue)]
        on_dspark = min(self.workers - 1, max(1, round(self.workers * self.dspark_share)))
        return [
            PoolSpec(dspark_pool, True, on_dspark, batch, self.max_queue),
            PoolSpec(standard_pool, False, self.workers - on_dspark, batch, self.max_queue),
        ]


def policy_section(policy: str, base: PolicyConfig, with_rules: bool) -> dict[str, Any]:
    """The policy section a policy runs: ``base`` (the config judged) with its objective set; the oracle and the
    single pools take nothing from it but the pool names and the seed."""
    names = {"dspark_pool": base.dspark_pool, "standard_pool": base.standard_pool, "seed": base.seed}
    if policy in SINGLE_POOL:
        pool = base.dspark_pool if SINGLE_POOL[policy] else base.standard_pool
        return {**names, "classifier": None, "default_pool": pool}
    if policy == "oracle":
        oracle = {"classifier": "default", "objective": "time_saved", "default_pool": base.standard_pool}
        return {**names, **oracle, "overflow": base.overflow}
    section = base.model_dump(exclude_none=True, exclude_unset=True, mode="json")
    section |= {"classifier": "default", "objective": "threshold" if policy == "threshold" else "time_saved"}
    if not with_rules:
        section["rules"] = []
    return section


def router_config(
    policy: str,
    base: PolicyConfig,
    specs: Sequence[PoolSpec],
    profile_file: Path,
    with_rules: bool,
    row_s: dict[bool, float],
) -> RouterConfig:
    """The config the policy is built from: ``base``'s policy over pools named as the simulated ones, each pool's
    ``load.profile`` the simulated machine's curve. Their sizes are the simulated pools' business: the policy
    reads workers, batch and queue from each pool's load, and a fleet has more workers than a config allows.
    Each pool's ``load.row_s`` is the profile's per-row cost, as an operator sets it from ``bench batching``."""
    pools = {
        spec.name: {
            "backend": "dspark" if spec.dspark else "autoregressive",
            "model": "simulated",
            "load": {"profile": str(profile_file), "row_s": row_s[spec.dspark]},
        }
        for spec in specs
    }
    return parse_config({"pools": pools, "policy": policy_section(policy, base, with_rules)}, base_dir=Path("."))


def routed_requests(items: Items, config: RouterConfig) -> list[RoutedRequest]:
    """Every item's request as the router parses it (its policy's defaults filled in), its item in metadata."""
    pools, defaults = frozenset(config.pools), config.policy.defaults.values()
    routed = []
    for index, item in enumerate(items.items):
        metadata = {**(item.body.get("metadata") or {}), ITEM_KEY: index}
        routed.append(parse_openai_args({**item.body, "metadata": metadata}, pools, defaults))
    return routed


def carried_speedups(items: Items, profile: CostProfile) -> list[float]:
    """Each item's solo speedup on the simulated machine: measured on the records' machine, carried by the two
    cost curves as the router carries the classifier's (:func:`~backends.scheduling.scaled_speedup`)."""
    if items.measured_on is None:
        return [item.speedup for item in items.items]
    return [
        scaled_speedup(item.speedup, items.measured_on, profile.curve, 1, profile.verify_tokens, profile.draft_s)
        for item in items.items
    ]


def sim_pools(
    specs: Sequence[PoolSpec], profile: CostProfile, items: Items, speedups: Sequence[float]
) -> list[SimPool]:
    """Fresh pools for one simulation; each item's forwards on each (tokens on standard, rounds on DSpark)."""
    tokens = [item.tokens for item in items.items]
    rounds = [t / profile.tokens_per_round(s) for t, s in zip(tokens, speedups, strict=True)]
    return [SimPool(spec, profile, rounds if spec.dspark else tokens) for spec in specs]


def decider(config: RouterConfig, scorer: Any, pools: Sequence[SimPool], routed: Sequence[RoutedRequest]) -> Decide:
    """The policy, built as ``Router`` builds it over these pools' loads, as the simulation's decision function."""
    loads = {pool.name: pool.load for pool in pools}
    estimator = LoadEstimator.for_pools(config, loads) if config.policy.objective == "time_saved" else None
    policy = Policy(config.policy, scorer, estimator)

    def decide(item: int) -> tuple[str, str, bool]:
        decision = policy.decide(routed[item])
        return decision.pool, decision.rule, decision.explored

    return decide


Scorers = Callable[[str, Sequence[RoutedRequest]], Any]
"""A policy's scorer, given its parsed requests (None for the single pools)."""


def classifier_scorers(classifier: Any, speedups: Sequence[float]) -> Scorers:
    """The classifier's numbers for the classified policies, each item's true speedup for the oracle."""

    def scorer(policy: str, routed: Sequence[RoutedRequest]) -> Any:
        if policy in SINGLE_POOL:
            return None
        if policy == "oracle":
            return OracleScorer(dict(enumerate(speedups)))
        return Prescored.of(classifier, [request.body for request in routed])

    return scorer


@dataclass(frozen=True)
class Judged:
    """What the policies are built from: the config's policy section, with or without its rules."""

    base: PolicyConfig
    with_rules: bool
    profile_file: Path
    """The simulated machine's curve in ``dspark_sps.json``'s layout (:meth:`CostProfile.sps_file`)."""


def simulate(
    policy: str,
    judged: Judged,
    fleet: Fleet,
    trace: Trace,
    arrivals: np.ndarray,
    scorers: Scorers,
    speedups: Sequence[float],
    progress: Callable[[int], None] | None = None,
) -> SimResult:
    """One policy over a fresh fleet, the trace's runs arriving at ``arrivals``."""
    base = judged.base
    specs = fleet.specs(policy, base.dspark_pool, base.standard_pool)
    row_s = {False: fleet.profile.standard_row_s, True: fleet.profile.dspark_row_s}
    config = router_config(policy, base, specs, judged.profile_file, judged.with_rules, row_s)
    routed = routed_requests(trace.items, config)
    pools = sim_pools(specs, fleet.profile, trace.items, speedups)
    decide = decider(config, scorers(policy, routed), pools, routed)
    return FleetSim(trace, pools, decide, config.policy.overflow).run(arrivals, progress)

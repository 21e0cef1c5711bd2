"""The routing policy: which pool a request should go to, and why.

Order of precedence: an explicit route hint, then the tenant's rules and the global rules in order (first match
wins), then the classifier, then ``default_pool``. The classifier decides by ``policy.objective``: ``threshold``
compares its score with the threshold; ``time_saved`` weighs its expected speedup against both pools' load right
now (``router/expected_time.py``). Only the last two steps are learned or arbitrary, so only they are explored:
a seeded share goes to the other pool, so both pools keep being measured on the traffic the classifier decides
and calibration never runs out of counterfactuals. Separately, a seeded ``shadow`` share of any request bound
for one of the two pools is replayed on the other once answered (see ``router/dispatch.py``), so the log holds
measured speedups for ``calibrate --from-log``. A full queue is not decided here, whatever the objective: the
dispatcher spills a full pool to its overflow target at admission.
"""

from __future__ import annotations

import math
import random
import threading
from typing import TYPE_CHECKING, Any

from classifiers import DEFAULT_THRESHOLD, SpeedupScorer
from router.config import PolicyConfig, Rule, RuleMatch, TenantOverride
from router.decisions import Decision
from router.errors import ConfigError, RoutingError
from router.request import RoutedRequest
from router.templates import TemplateSpeeds, blended

if TYPE_CHECKING:
    from classifiers import Scorer
    from router.expected_time import LoadEstimator


def rule_matches(match: RuleMatch, routed: RoutedRequest) -> bool:
    request = routed.request
    checks = (
        match.response_format is None or routed.response_format_type in match.response_format,
        match.tools is None or routed.has_tools == match.tools,
        match.temperature is None or match.temperature.min <= request.temperature <= match.temperature.max,
        match.prompt_regex is None or match.prompt_regex.search(routed.last_user_text) is not None,
        match.tags is None or set(match.tags) <= routed.tags,
    )
    return all(checks)


def _calibrated_threshold(scorer: Scorer | None) -> float:
    """The scorer's own ``threshold`` (0.5 without one), checked once so a bad one fails at start-up."""
    value = getattr(scorer, "threshold", DEFAULT_THRESHOLD)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ConfigError("policy.classifier", f"the classifier's threshold {value!r} is not a number in [0, 1]")
    return float(value)


def _number(value: object) -> float:
    """A scorer's answer as a float; NaN (refused by the range checks) for anything that is not a number."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _check_time_saved(config: PolicyConfig, scorer: Scorer | None, estimator: LoadEstimator | None) -> None:
    """``time_saved`` needs speedups to weigh and loads to weigh them against; checked once, at start-up."""
    if config.objective != "time_saved" or scorer is None:
        return
    if not isinstance(scorer, SpeedupScorer) or not scorer.predicts_speedup:
        raise ConfigError(
            "policy.classifier",
            "objective time_saved needs a classifier with an expected-gain model, and this one has none "
            "(retrain it with dspark-router calibrate)",
        )
    if estimator is None:
        raise ConfigError("policy.objective", "time_saved needs the pools' load (build the policy with an estimator)")


class Policy:
    """``estimator`` reads the pools' load for ``objective: time_saved``; the router builds it over its pools."""

    def __init__(
        self,
        config: PolicyConfig,
        scorer: Scorer | None,
        estimator: LoadEstimator | None = None,
        templates: TemplateSpeeds | None = None,
    ) -> None:
        """``templates``: what answers measured per template (:mod:`router.templates`), read under ``time_saved``."""
        _check_time_saved(config, scorer, estimator)
        self.config = config
        self.templates = templates
        self.scorer = scorer
        self.estimator = estimator
        self._scorer_threshold = _calibrated_threshold(scorer)
        self._rng = random.Random(config.seed)
        self._rng_lock = threading.Lock()

    def decide(self, routed: RoutedRequest) -> Decision:
        return self._shadow(self._choose(routed))

    def _choose(self, routed: RoutedRequest) -> Decision:
        config, tenant = self.config, routed.tenant
        override = config.tenants.get(tenant) if tenant else None

        def decision(pool: str, rule: str, reason: str, score: float | None = None) -> Decision:
            return Decision(pool=pool, policy_pool=pool, rule=rule, reason=reason, score=score, tenant=tenant)

        if config.hints and routed.hint is not None:
            return decision(routed.hint, "hint", f"route hint names {routed.hint!r}")
        rules: list[Rule] = [*(override.rules if override else []), *config.rules]
        for rule in rules:
            if rule_matches(rule.match, routed):
                return decision(rule.pool, rule.name, f"rule {rule.name!r} matched")
        if self.scorer is not None and config.objective == "time_saved":
            chosen = self._time_saved(routed)
        elif self.scorer is not None:
            score, threshold = self._score(routed), self._threshold(override)
            above = score >= threshold
            reason = f"score {score:.3f} {'>=' if above else '<'} threshold {threshold:.3f}"
            chosen = decision(config.dspark_pool if above else config.standard_pool, "classifier", reason, score)
        else:
            default = self._setting(override, "default_pool")
            if default is None:
                raise RoutingError("no rule matched, no classifier is loaded and policy.default_pool is not set")
            chosen = decision(default, "default", "no rule matched and no classifier: default pool")
        return self._explore(chosen, self._setting(override, "explore"))

    def _time_saved(self, routed: RoutedRequest) -> Decision:
        """The pool the request is expected to finish on first, from the classifier's expected speedup moved towards
        what its template measured; a repeated template DSpark never answered, or not for a while, goes there to be
        measured."""
        speedup = self._expected_speedup(routed)
        key = routed.template if self.templates is not None else None
        reason = self.templates.probe(key) if key is not None else None
        if reason is not None:
            pool = self.config.dspark_pool
            return Decision(pool=pool, policy_pool=pool, rule="template_probe", reason=reason, tenant=routed.tenant)
        measured = self.templates.speedup(key) if key is not None else None
        if measured is not None:
            speedup = blended(speedup, measured)
        measured_on = getattr(self.scorer, "calibration_curve", None)
        verdict = self.estimator.choose(speedup, routed.request.max_tokens, measured_on)
        reason = verdict.reason
        if measured is not None:
            reason += f"; its template measured {measured.speedup:.2f}x over {measured.answers} DSpark answers"
        return Decision(
            pool=verdict.pool,
            policy_pool=verdict.pool,
            rule="time_saved",
            reason=reason,
            tenant=routed.tenant,
            expected_speedup=speedup,
            load=verdict.seen,
        )

    def _expected_speedup(self, routed: RoutedRequest) -> float:
        speedup = self.scorer.expected_speedup(routed.body)
        value = _number(speedup)
        if not 0.0 < value < math.inf:
            raise RoutingError(f"the classifier expected a speedup of {speedup!r}; it must be a positive number")
        return value

    def _setting(self, override: TenantOverride | None, name: str) -> Any:
        """The tenant's value where it sets one, else the policy's."""
        value = getattr(override, name) if override is not None else None
        return getattr(self.config, name) if value is None else value

    def _threshold(self, override: TenantOverride | None) -> float:
        """The tenant's or the policy's threshold, else the one the classifier was calibrated to route at."""
        threshold = self._setting(override, "threshold")
        return self._scorer_threshold if threshold is None else threshold

    def _score(self, routed: RoutedRequest) -> float:
        score = self.scorer.score(routed.body)
        value = _number(score)
        if not 0.0 <= value <= 1.0:
            raise RoutingError(f"the classifier returned {score!r}; a score must be a number in [0, 1]")
        return value

    def _explore(self, chosen: Decision, share: float) -> Decision:
        other = self._other_if_drawn(chosen, share)
        if other is None:
            return chosen
        reason = f"{chosen.reason}; explored {other!r} (share {share:.2f})"
        return chosen.model_copy(update={"pool": other, "explored": True, "reason": reason})

    def _shadow(self, chosen: Decision) -> Decision:
        other = self._other_if_drawn(chosen, self.config.shadow)
        return chosen if other is None else chosen.model_copy(update={"shadow": other})

    def _other_if_drawn(self, chosen: Decision, share: float) -> str | None:
        """The other of the dspark/standard pair, for a seeded ``share`` of the decisions that chose one of them."""
        pools = (self.config.dspark_pool, self.config.standard_pool)
        if share <= 0 or chosen.pool not in pools:
            return None
        with self._rng_lock:
            if self._rng.random() >= share:
                return None
        return pools[1] if chosen.pool == pools[0] else pools[0]

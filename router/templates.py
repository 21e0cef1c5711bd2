"""What the router learnt of each template: how much faster the DSpark pool decoded its requests than the standard.

An agent sends many requests of one template (the same system prompt, schema or tool, different content), and the
DSpark pool learns the template as it answers it: its traffic cache drafts the next answers from the earlier ones
(:mod:`backends.dspark.traffic`), so a template's speedup grows with its requests, which the classifier cannot see
in one request's text. The router keeps, per template (:attr:`~router.request.RoutedRequest.template`: the
tenant's system prompt, schema and tools), the seconds per output token each pool took (the backend's
own timing, no queue), and the expected-time policy weighs the measured speedup against the classifier's from the
second measured DSpark answer on (:meth:`TemplateSpeeds.speedup`). A template no DSpark answer measured is judged by
the classifier, as any cold request; one the router has seen :data:`PROBE_AFTER` times and DSpark never answered
goes to DSpark until it has :data:`MIN_MEASURED` answers there (a probe: a repeated template is what the pool can
learn, and without one measured answer nothing would ever move the classifier's verdict). And a template judged for
the standard pool goes to DSpark again once every :data:`REPROBE_AFTER` of its requests: its DSpark speed grows with
the answers the DSpark pool's cache holds of it, and only DSpark's own answers fill that cache, so a verdict from
its first two, drafted from almost nothing, would otherwise stand for good (the trace's rewrites: 4 of 20 requests
to DSpark through ``auto``, where DSpark ran 1.21x the standard pool from the 9th request on).

Templates are kept per cache scope (the tenant, within the API key), as the pool's caches are: what one tenant's
traffic taught the pool says nothing of another's. Bounded: the least recently seen template goes first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

REPROBE_AFTER = 8
"""Requests of a template since DSpark last answered one, after which the next goes there to be measured again."""
MIN_MEASURED = 2
"""DSpark answers of a template before its measured speedup counts: one answer is mostly its own content."""
PROBE_AFTER = 4
"""Requests of a template the router sees before it sends one to DSpark to measure, if none went there."""
PRIOR_WEIGHT = 2.0
"""What the classifier's expected speedup weighs against the template's measured answers (each worth one)."""
MOST_WEIGHT = 16
"""The most measured answers a template's speedup counts: a template drifts, and the newest answers say most."""
WEIGHT = 0.25
"""How far each new answer moves a template's seconds per token: about the last eight answers count."""
MAX_TEMPLATES = 4096


@dataclass
class _Template:
    seen: int = 0
    seconds_per_token: dict[str, float] = field(default_factory=dict)
    """Per pool, an average over the template's recent answers there (recent ones weigh most)."""
    measured: dict[str, int] = field(default_factory=dict)
    dspark_at: int = 0
    """``seen`` when DSpark last answered the template."""


@dataclass(frozen=True)
class Measured:
    speedup: float
    """The standard pool's seconds per output token over the DSpark pool's, on this template (or, where the
    standard pool answered none of it, the standard pool's over all templates)."""
    answers: int
    """DSpark answers behind it."""


class TemplateSpeeds:
    """Per template, what each of the pair's pools took per output token; thread-safe (results arrive on worker
    threads while requests are routed)."""

    def __init__(self, dspark_pool: str, standard_pool: str) -> None:
        self.dspark_pool, self.standard_pool = dspark_pool, standard_pool
        self._templates: OrderedDict[str, _Template] = OrderedDict()
        self._standard: float | None = None
        """The standard pool's seconds per token over every answer: the baseline for a template it never answered."""
        self._lock = threading.Lock()

    def seen(self, key: str) -> None:
        """A request of template ``key`` was routed."""
        with self._lock:
            self._template(key).seen += 1

    def observe(self, key: str | None, pool: str, seconds: float, tokens: int) -> None:
        """An answer of ``pool`` took ``seconds`` (the backend's own time) for ``tokens`` output tokens."""
        if pool not in (self.dspark_pool, self.standard_pool) or tokens <= 0 or seconds <= 0:
            return
        per_token = seconds / tokens
        with self._lock:
            if pool == self.standard_pool:
                self._standard = _moved(self._standard, per_token)
            if key is None:
                return
            template = self._template(key)
            template.seconds_per_token[pool] = _moved(template.seconds_per_token.get(pool), per_token)
            template.measured[pool] = template.measured.get(pool, 0) + 1
            if pool == self.dspark_pool:
                template.dspark_at = template.seen

    def speedup(self, key: str | None) -> Measured | None:
        """The template's measured speedup, once DSpark answered it :data:`MIN_MEASURED` times."""
        if key is None:
            return None
        with self._lock:
            template = self._templates.get(key)
            if template is None or template.measured.get(self.dspark_pool, 0) < MIN_MEASURED:
                return None
            standard = template.seconds_per_token.get(self.standard_pool, self._standard)
            if standard is None:
                return None
            dspark = template.seconds_per_token[self.dspark_pool]
            return Measured(standard / dspark, template.measured[self.dspark_pool])

    def probe(self, key: str | None) -> str | None:
        """Why this request of a repeated template should go to DSpark to be measured there, or None."""
        if key is None:
            return None
        with self._lock:
            template = self._templates.get(key)
            if template is None or template.seen <= PROBE_AFTER:
                return None
            if template.measured.get(self.dspark_pool, 0) < MIN_MEASURED:
                return "a repeated template the DSpark pool has not answered yet: measured there"
            if template.seen - template.dspark_at > REPROBE_AFTER:
                return f"{REPROBE_AFTER} requests of this template since DSpark last answered one: measured there again"
            return None

    def _template(self, key: str) -> _Template:
        template = self._templates.get(key)
        if template is None:
            template = self._templates[key] = _Template()
            if len(self._templates) > MAX_TEMPLATES:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(key)
        return template


def blended(expected: float, measured: Measured) -> float:
    """The classifier's expected speedup moved towards the template's measured one by its answers."""
    answers = min(measured.answers, MOST_WEIGHT)
    return (PRIOR_WEIGHT * expected + answers * measured.speedup) / (PRIOR_WEIGHT + answers)


def _moved(average: float | None, value: float) -> float:
    return value if average is None else average + WEIGHT * (value - average)

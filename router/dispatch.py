"""Carry one request through the pools: admit it (spilling a full pool to its overflow target), run it, retry a
failed attempt once on the fallback pool, then measure, count and log the outcome.

A request the policy marked for a shadow run is, once answered, replayed on the other pool of the dspark/standard
pair, and its log record waits for that run: both pools' timings on the same request give the measured speedup
that ``calibrate --from-log`` learns from. The replay never delays the answer, never waits for room in a full
pool, and its cost is the shadow share of extra decoding.

All of it happens in ``submit`` (non-blocking) and in the attempts' done-callbacks, and ends in one
:class:`~concurrent.futures.Future`: the sync, async and streaming front ends all wait on that same future, so
spill and fallback behave identically for each. A stream falls back only while it has sent nothing, because a
retry cannot take back text the caller has already seen.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError

from backends.errors import DSparkRouterError, InvalidRequestError
from backends.types import GenerationRequest, GenerationResult, StreamChunk
from router.config import PoolConfig
from router.decisions import Decision, Measured, RoutedResult, RouteRecord, Sampling
from router.errors import PoolClosedError, PoolUnavailableError, QueueFullError, StreamClosed, WorkerLostError
from router.health import PoolHealth
from router.metrics import RouterMetrics
from router.pool import WAIT_GRACE_S, Pool
from router.records import DecisionLog
from router.request import RoutedRequest
from router.templates import TemplateSpeeds

OnDelta = Callable[[str, Decision], None]


class Dispatcher:
    def __init__(
        self,
        pools: dict[str, Pool],
        configs: dict[str, PoolConfig],
        overflow: dict[str, str],
        fallback: dict[str, str],
        metrics: RouterMetrics,
        log: DecisionLog,
        health: dict[str, PoolHealth],
        speed_pair: tuple[str, str] = ("dspark", "standard"),
        templates: TemplateSpeeds | None = None,
    ) -> None:
        """``templates``: where each answer's time per token is kept by template, for the policy to read."""
        self.templates = templates
        self.pools = pools
        self.configs = configs
        self.health = health
        self.overflow = overflow
        self.fallback = fallback
        self.metrics = metrics
        self.log = log
        self.speed_pair = speed_pair

    def start(self, routed: RoutedRequest, decision: Decision, on_delta: OnDelta | None = None) -> Flight:
        """Admit the request now (raising :class:`QueueFullError` if nowhere has room) and return its flight."""
        flight = Flight(self, routed, decision, on_delta)
        flight.submit()
        return flight

    def preview(self, routed: RoutedRequest, decision: Decision) -> Decision:
        """The decision as admission would leave it right now: spilled if its pool is full and may spill, with the
        sampling settings that pool would decode with."""
        target = self.overflow.get(decision.pool)
        if target is not None and self.pools[decision.pool].full:
            decision = spilled(decision, target)
        return with_sampling(decision, self.request_for(routed, decision.pool))

    def request_for(self, routed: RoutedRequest, pool: str) -> GenerationRequest:
        return routed.for_pool(pool, self.configs[pool])

    def budget_s(self, pool: str) -> float:
        """An upper bound on how long a request first sent to ``pool`` can take, spill and fallback included."""
        reachable = {pool, self.overflow.get(pool)}
        reachable |= {self.fallback.get(p) for p in set(reachable)}
        return sum(self.pools[p].timeout_s for p in reachable if p is not None) + WAIT_GRACE_S

    def speedup(self, stats: dict[str, dict[str, float | int | None]]) -> float | None:
        """DSpark's speedup over the standard pool in time per output token, when ``stats`` holds both pools."""
        dspark, standard = (stats.get(name) for name in self.speed_pair)
        if not dspark or not standard or not dspark["completion_tokens"] or not standard["completion_tokens"]:
            return None
        dspark_time = dspark["wall_time_s"] / dspark["completion_tokens"]
        standard_time = standard["wall_time_s"] / standard["completion_tokens"]
        return standard_time / dspark_time if dspark_time > 0 else None


def with_sampling(decision: Decision, request: GenerationRequest) -> Decision:
    return decision.model_copy(update={"sampling": Sampling.of(request)})


def spilled(decision: Decision, target: str) -> Decision:
    reason = f"{decision.reason}; {decision.pool!r} was full, spilled to {target!r}"
    return decision.model_copy(update={"pool": target, "overflowed": True, "reason": reason})


def retryable(error: BaseException) -> bool:
    """A pool's failure (load, backend, timeout) may succeed elsewhere; a bad request or a gone consumer not."""
    return not isinstance(error, InvalidRequestError | StreamClosed)


class Flight:
    """One request on its way through the pools; ``outcome`` resolves with the :class:`RoutedResult` or the error."""

    def __init__(self, dispatcher: Dispatcher, routed: RoutedRequest, decision: Decision, on_delta: OnDelta | None):
        self.dispatcher = dispatcher
        self.routed = routed
        self.decision = decision
        self.on_delta = on_delta
        self.admitted = routed.request
        self.budget_s = dispatcher.budget_s(decision.pool)
        self.outcome: Future[RoutedResult] = Future()
        self._started = time.perf_counter()
        self._first_delta_at: float | None = None
        self._attempt: Future[GenerationResult] | None = None
        self._cancelled = False

    def cancel(self) -> None:
        """Stop the request for a caller that went away: an attempt still queued leaves its pool's queue now, a
        running one ends at its next chunk (within one decoding step), and nothing is retried elsewhere. The outcome
        fails with :class:`StreamClosed`; cancelling a finished flight changes nothing."""
        if self.outcome.done():
            return
        self._cancelled = True
        if self._attempt is not None:
            self._attempt.cancel()  # succeeds only while the attempt waits for a worker

    def submit(self) -> None:
        d = self.dispatcher
        try:
            attempt = self._submit_to_decided_pool()
        except QueueFullError as full:
            target = d.overflow.get(self.decision.pool)
            if target is None or self.decision.overflowed:
                raise
            d.metrics.overflows.labels(self.decision.pool, target).inc()
            self.decision = spilled(self.decision, target)
            try:
                attempt = self._submit_to_decided_pool()
            except QueueFullError as also_full:
                raise QueueFullError(f"{full.message}; {also_full.message}") from None
        except PoolUnavailableError as down:  # cooled down or unreachable: its fallback, at once, if it has one
            target = d.fallback.get(self.decision.pool)
            if target is None or self.decision.fell_back:
                raise
            self._fell_back_to(target, down)
            attempt = self._submit_to_decided_pool()
        self._attempt = attempt
        attempt.add_done_callback(self._attempt_done)
        if d.templates is not None and self.routed.template is not None:
            d.templates.seen(self.routed.template)

    def _submit_to_decided_pool(self) -> Future[GenerationResult]:
        """The request as the decision's pool decodes it (its defaults and cap), recorded in the decision first,
        since the worker may report chunks before ``submit`` returns."""
        pool = self.decision.pool
        self.dispatcher.health[pool].admit()
        self.admitted = self.dispatcher.request_for(self.routed, pool)
        self.decision = with_sampling(self.decision, self.admitted)
        return self.dispatcher.pools[pool].submit(self.admitted, on_chunk=self._on_chunk)

    def _on_chunk(self, chunk: StreamChunk) -> None:
        if self._cancelled:  # before the empty-delta check: a step that streams nothing still ends here
            raise StreamClosed("the request was cancelled")
        if not chunk.delta:
            return
        if self._first_delta_at is None:
            self._first_delta_at = time.perf_counter()
        if self.on_delta is not None:
            self.on_delta(chunk.delta, self.decision)

    def _attempt_done(self, attempt: Future[GenerationResult]) -> None:
        """Runs in the worker that finished; whatever happens here must resolve ``outcome``, or a caller would hang."""
        try:
            error = self._attempt_error(attempt)
            self._count_health(error)
            if error is None:
                self._succeed(attempt.result())
            elif not self._fall_back(error):
                self._fail(error)
        except BaseException as exc:
            self._fail(exc)

    def _attempt_error(self, attempt: Future[GenerationResult]) -> BaseException | None:
        if not attempt.cancelled():
            return attempt.exception()
        return StreamClosed("the request was cancelled") if self._cancelled else PoolClosedError("the pool was closed")

    def _fall_back(self, error: BaseException) -> bool:
        d = self.dispatcher
        target = d.fallback.get(self.decision.pool)
        streamed = self.on_delta is not None and self._first_delta_at is not None
        if self._cancelled or target is None or self.decision.fell_back or streamed or not retryable(error):
            return False
        self._fell_back_to(target, error)
        self._first_delta_at = None
        try:
            self.submit()
        except DSparkRouterError as again:
            self._fail(again)
        return True

    def _fell_back_to(self, target: str, error: BaseException) -> None:
        d = self.dispatcher
        d.metrics.failed(self.decision.pool, error)
        d.metrics.fallbacks.labels(self.decision.pool, target).inc()
        reason = f"{self.decision.reason}; {self.decision.pool!r} failed ({error}), fell back to {target!r}"
        self.decision = self.decision.model_copy(update={"pool": target, "fell_back": True, "reason": reason})

    def _count_health(self, error: BaseException | None) -> None:
        """A pool's own failures count towards its cooldown; a bad request, a caller gone away or a worker that died
        holding this request (:class:`WorkerLostError`: that worker's fault, while the pool's others serve) not."""
        health = self.dispatcher.health[self.decision.pool]
        if error is None:
            health.succeeded()
        elif retryable(error) and not isinstance(error, WorkerLostError):
            health.failed(error)

    def _ttft(self, result: GenerationResult, now: float) -> float:
        """Until the first delta arrived; where none did before the answer (a Redis worker sends a job that does not
        stream no chunks), the latency less what the backend spent after its first token."""
        stats = result.stats
        if self._first_delta_at is None and stats.time_to_first_token_s is not None and stats.wall_time_s:
            return max(0.0, now - self._started - (stats.wall_time_s - stats.time_to_first_token_s))
        return (self._first_delta_at or now) - self._started

    def _succeed(self, result: GenerationResult) -> None:
        now = time.perf_counter()
        latency = now - self._started
        kind = self.dispatcher.pools[self.decision.pool].kind
        measured = Measured(
            latency_s=latency,
            ttft_s=self._ttft(result, now),
            tokens_per_s=result.stats.tokens_per_s or result.usage.completion_tokens / latency,
            queue_s=max(0.0, latency - result.stats.wall_time_s) if result.stats.wall_time_s else 0.0,
            mean_accepted_tokens=_mean_accepted(result, kind),
        )
        routed = RoutedResult(
            **dict(result), request_id=self.routed.request_id, decision=self.decision, measured=measured
        )
        self.dispatcher.metrics.finished(self.decision, measured)
        if self.dispatcher.templates is not None:
            self.dispatcher.templates.observe(
                self.routed.template, self.decision.pool, result.stats.wall_time_s, result.usage.completion_tokens
            )
        stats = {self.decision.pool: _pool_stats(result, kind)}
        fields = {"measured": measured, "finish_reason": result.finish_reason, "usage": result.usage}
        shadow = self._start_shadow()
        if shadow is None:
            self._record(stats=stats, **fields)
        else:
            shadow.add_done_callback(lambda run: self._record_with_shadow(run, stats, fields))
        _resolve(self.outcome, result=routed)

    def _start_shadow(self) -> Future[GenerationResult] | None:
        """The replay of the answered request, as it was decoded, on the decision's shadow pool; None when there is
        none, the request ended up there anyway (spilled, fell back), or the pool has no room."""
        name = self.decision.shadow
        d = self.dispatcher
        if name is None or name == self.decision.pool:
            return None
        try:
            return d.pools[name].submit(self.admitted)
        except DSparkRouterError:  # full (QueueFullError) or closed: the record goes out without a speedup
            d.metrics.shadow_runs.labels(name, "skipped").inc()
            return None

    def _record_with_shadow(self, run: Future[GenerationResult], stats: dict, fields: dict[str, object]) -> None:
        """The record, with the shadow pool's timings and the speedup when the replay succeeded, else as it was."""
        name, metrics = self.decision.shadow, self.dispatcher.metrics
        if name is not None and not run.cancelled() and run.exception() is None:
            stats[name] = _pool_stats(run.result(), self.dispatcher.pools[name].kind)
        speedup = self.dispatcher.speedup(stats)
        metrics.shadow_runs.labels(name, "failed" if speedup is None else "measured").inc()
        if speedup is not None:
            metrics.speedup.observe(speedup)
        self._record(stats=stats, speedup=speedup, **fields)

    def _fail(self, error: BaseException) -> None:
        self.dispatcher.metrics.failed(self.decision.pool, error)
        self._record(error=f"{type(error).__name__}: {error}")
        _resolve(self.outcome, error=error)

    def _record(self, **fields: object) -> None:
        record = RouteRecord(
            request_id=self.routed.request_id, decision=self.decision, request=self.routed.body, **fields
        )
        self.dispatcher.log.write(record)


def _pool_stats(result: GenerationResult, kind: str) -> dict[str, float | int | None]:
    """The backend's own timings: no queue wait, so a shadow run and the answer compare fairly."""
    return {
        "wall_time_s": result.stats.wall_time_s,
        "tokens_per_s": result.stats.tokens_per_s,
        "completion_tokens": result.usage.completion_tokens,
        "forward_passes": result.stats.forward_passes,
        "mean_accepted": _mean_accepted(result, kind),
    }


def _mean_accepted(result: GenerationResult, kind: str) -> float | None:
    if result.stats.spans is not None:
        return result.stats.spans.mean_accepted
    return 1.0 if kind == "autoregressive" and result.usage.completion_tokens else None


def _resolve(
    outcome: Future[RoutedResult], *, result: RoutedResult | None = None, error: BaseException | None = None
) -> None:
    try:
        if error is not None:
            outcome.set_exception(error)
        else:
            outcome.set_result(result)
    except InvalidStateError:
        pass  # resolved already: a failure while finishing a result that was delivered

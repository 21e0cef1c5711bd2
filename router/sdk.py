"""The Python SDK: ``Router`` takes OpenAI chat-completions arguments and returns results that carry their decision.

``complete``/``acomplete``/``stream``/``astream`` generate; ``route`` only decides (a dry run: no model is
loaded); ``map``/``amap`` run an agent's fan-out of subtasks concurrently and return results in input order.

Arguments: see :mod:`router.request`. In short, every chat-completions argument that changes the output is
honoured; ``model`` (``dspark-router/auto``, ``dspark-router/<pool>``), ``metadata`` (``route``, ``tenant``,
``tags``) and ``user`` (the tenant when metadata has none) steer routing; OpenAI arguments the backends cannot
honour are accepted at their no-op value (``n=1``, ``presence_penalty=0``, ...) and refused by name otherwise.
``stream=True`` makes ``complete``/``acomplete`` return the chunk iterator, as the OpenAI client does.

``request_id`` (keyword-only, beside the OpenAI arguments rather than among them) names the request in its
result and its decision record: the gateway passes the client's ``x-request-id`` so both sides log one id.
A caller that stops waiting stops the work: a cancelled or timed-out ``acomplete``, an interrupted ``complete``
and a stream left early each cancel their flight, which ends decoding within one step and frees the pool slot.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

from backends.errors import InvalidRequestError
from router.config import RouterConfig, load_config
from router.decisions import Decision, RoutedChunk, RoutedResult
from router.dispatch import Dispatcher, Flight, OnDelta
from router.errors import ConfigError, PoolTimeoutError
from router.expected_time import LoadEstimator
from router.feeds import AsyncFeed, Feed
from router.health import HealthChecks, PoolHealth, probe_for
from router.metrics import RouterMetrics
from router.policy import Policy
from router.pool import Pool, wait_result
from router.pool_factory import build_pool
from router.records import DecisionLog
from router.request import parse_openai_args
from router.templates import TemplateSpeeds

if TYPE_CHECKING:
    from classifiers import Scorer


class _Scorer(Enum):
    FROM_CONFIG = "from-config"


FROM_CONFIG = _Scorer.FROM_CONFIG


class Router:
    """Routes each request to a pool by its policy and runs it there.

    ``scorer`` overrides the config's classifier (any object with ``score(request_dict) -> float``, and
    optionally the ``threshold`` it routes at; ``None`` for none). ``pools`` replaces the in-process pools with
    other :class:`~router.pool.Pool` implementations, one per pool the config declares.
    """

    def __init__(
        self,
        config: RouterConfig,
        *,
        scorer: Scorer | Literal[_Scorer.FROM_CONFIG] | None = FROM_CONFIG,
        pools: Mapping[str, Pool] | None = None,
    ) -> None:
        if pools is not None and set(pools) != set(config.pools):
            raise ConfigError(
                "pools", f"the pools given ({sorted(pools)}) differ from the config's ({sorted(config.pools)})"
            )
        if scorer is FROM_CONFIG:
            from router.classifier import resolve_scorer

            scorer = resolve_scorer(config.policy.classifier)
        self.config = config
        self.pools: dict[str, Pool] = dict(pools or {n: build_pool(n, c) for n, c in config.pools.items()})
        policy = config.policy
        templates = TemplateSpeeds(policy.dspark_pool, policy.standard_pool) if policy.learn_templates else None
        self.policy = Policy(policy, scorer, self._estimator(), templates)
        self.metrics = RouterMetrics()
        self.metrics.watch(self.pools)
        self.log = DecisionLog.from_config(config.log, config.redis_url)
        self.health = {
            n: PoolHealth(n, config.pools[n], probe_for(config.pools[n], p), serving=getattr(p, "serving", None))
            for n, p in self.pools.items()
        }
        self._health_checks = HealthChecks(self.health)
        self.dispatcher = Dispatcher(
            self.pools,
            config.pools,
            config.policy.overflow,
            config.policy.fallback,
            self.metrics,
            self.log,
            self.health,
            speed_pair=(config.policy.dspark_pool, config.policy.standard_pool),
            templates=templates,
        )
        self._pool_names = frozenset(self.pools)
        self._defaults = config.policy.defaults.values()

    @classmethod
    def from_config(
        cls,
        path: str | Path | None = None,
        *,
        scorer: Scorer | Literal[_Scorer.FROM_CONFIG] | None = FROM_CONFIG,
        check_paths: bool = True,
    ) -> Router:
        """A YAML config file, or with no path the embedded default (see :func:`router.config.load_config`)."""
        return cls(load_config(path, check_paths=check_paths), scorer=scorer)

    def _estimator(self) -> LoadEstimator | None:
        """What ``objective: time_saved`` weighs speedups against: the pools' load, read at every decision."""
        if self.config.policy.objective != "time_saved":
            return None
        return LoadEstimator.for_pools(self.config, {name: pool.load for name, pool in self.pools.items()})

    def route(self, **args: Any) -> Decision:
        """The decision for these arguments, without generating: nothing is counted, logged or loaded."""
        routed = parse_openai_args(args, self._pool_names, self._defaults)
        return self.dispatcher.preview(routed, self.policy.decide(routed))

    @overload
    def complete(
        self,
        *,
        stream: Literal[False] = False,
        request_id: str | None = None,
        principal: str | None = None,
        **args: Any,
    ) -> RoutedResult: ...

    @overload
    def complete(
        self, *, stream: Literal[True], request_id: str | None = None, principal: str | None = None, **args: Any
    ) -> Iterator[RoutedChunk]: ...

    def complete(
        self, *, stream: bool = False, request_id: str | None = None, principal: str | None = None, **args: Any
    ) -> RoutedResult | Iterator[RoutedChunk]:
        if stream:
            return self.stream(request_id=request_id, principal=principal, **args)
        flight = self._start(args, request_id=request_id, principal=principal)
        try:
            return wait_result(flight.outcome, flight.budget_s, f"pool {flight.decision.pool!r}")
        finally:
            flight.cancel()

    @overload
    async def acomplete(
        self,
        *,
        stream: Literal[False] = False,
        request_id: str | None = None,
        principal: str | None = None,
        **args: Any,
    ) -> RoutedResult: ...

    @overload
    async def acomplete(
        self, *, stream: Literal[True], request_id: str | None = None, principal: str | None = None, **args: Any
    ) -> AsyncIterator[RoutedChunk]: ...

    async def acomplete(
        self, *, stream: bool = False, request_id: str | None = None, principal: str | None = None, **args: Any
    ) -> RoutedResult | AsyncIterator[RoutedChunk]:
        if stream:
            return self.astream(request_id=request_id, principal=principal, **args)
        flight = self._start(args, request_id=request_id, principal=principal)
        outcome = asyncio.wrap_future(flight.outcome)
        try:
            return await asyncio.wait_for(asyncio.shield(outcome), flight.budget_s)
        except asyncio.TimeoutError:  # not yet the builtin TimeoutError on Python 3.10
            raise PoolTimeoutError(f"pool {flight.decision.pool!r} gave no answer in {flight.budget_s:g}s") from None
        finally:
            flight.cancel()  # timed out, or the awaiting task was cancelled (its client went away)
            outcome.add_done_callback(_abandoned)

    def stream(
        self, *, request_id: str | None = None, principal: str | None = None, **args: Any
    ) -> Iterator[RoutedChunk]:
        """Chunks with their decision; the last carries the whole result. Leaving the loop early stops decoding."""
        feed: Feed[tuple[str, Decision]] = Feed()
        flight = self._start(
            {**args, "stream": True},
            lambda delta, decision: feed.put((delta, decision)),
            request_id=request_id,
            principal=principal,
        )
        try:
            for delta, decision in feed.drain(flight.outcome, flight.budget_s, f"pool {flight.decision.pool!r}"):
                yield RoutedChunk(delta=delta, decision=decision)
            yield _last_chunk(flight.outcome.result())
        finally:
            flight.cancel()

    async def astream(
        self, *, request_id: str | None = None, principal: str | None = None, **args: Any
    ) -> AsyncIterator[RoutedChunk]:
        feed: AsyncFeed[tuple[str, Decision]] = AsyncFeed()
        flight = self._start(
            {**args, "stream": True},
            lambda delta, decision: feed.put((delta, decision)),
            request_id=request_id,
            principal=principal,
        )
        try:
            async for delta, decision in feed.drain(flight.outcome, flight.budget_s, f"pool {flight.decision.pool!r}"):
                yield RoutedChunk(delta=delta, decision=decision)
            yield _last_chunk(flight.outcome.result())
        finally:
            flight.cancel()

    def map(
        self, subtasks: Iterable[Mapping[str, Any]], *, concurrency: int = 4, return_exceptions: bool = True
    ) -> list[RoutedResult | Exception]:
        """Run subtasks (each the keyword arguments of :meth:`complete`) at most ``concurrency`` at a time.

        Results come back in input order. With ``return_exceptions`` (the default) a failed subtask's exception
        takes its slot, so one failure loses nothing else; without it, the first failure in input order is
        raised once all subtasks have finished.
        """
        tasks = list(subtasks)
        if concurrency < 1:
            raise InvalidRequestError("concurrency must be at least 1", param="concurrency")
        with ThreadPoolExecutor(max_workers=min(concurrency, max(1, len(tasks))), thread_name_prefix="map") as pool:
            futures = [pool.submit(lambda task=task: self.complete(**task)) for task in tasks]
            outcomes = [f.exception() or f.result() for f in futures]
        return _gathered(outcomes, return_exceptions)

    async def amap(
        self, subtasks: Iterable[Mapping[str, Any]], *, concurrency: int = 4, return_exceptions: bool = True
    ) -> list[RoutedResult | Exception]:
        """:meth:`map` for an event loop."""
        if concurrency < 1:
            raise InvalidRequestError("concurrency must be at least 1", param="concurrency")
        gate = asyncio.Semaphore(concurrency)

        async def one(task: Mapping[str, Any]) -> RoutedResult:
            async with gate:
                return await self.acomplete(**task)

        outcomes = await asyncio.gather(*(one(task) for task in subtasks), return_exceptions=True)
        return _gathered(outcomes, return_exceptions)

    def warmup(self) -> None:
        """Load every pool's models now, so the first requests do not pay for it."""
        for pool in self.pools.values():
            pool.warmup()

    def metrics_text(self) -> str:
        """This router's metrics in the Prometheus exposition format."""
        return self.metrics.text()

    def unavailable(self) -> dict[str, str]:
        """Pools that take no requests right now (cooled down after failures, or their Redis unreachable), and why:
        what a readiness check reports."""
        return {name: problem for name, health in self.health.items() if (problem := health.report()) is not None}

    def close(self) -> None:
        self._health_checks.close()
        for pool in self.pools.values():
            pool.close()
        self.log.close()

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _start(
        self,
        args: dict[str, Any],
        on_delta: OnDelta | None = None,
        *,
        request_id: str | None = None,
        principal: str | None = None,
    ) -> Flight:
        """Parse, decide and admit; a failure here (bad request, no place, full queues) is raised to the caller.
        ``principal``: who the caller is as authenticated (the gateway's API key), never a request's own field: a
        pool's traffic cache is kept per principal and the tenant it names within."""
        pool = "none"
        try:
            routed = parse_openai_args(args, self._pool_names, self._defaults)
            routed = dataclasses.replace(routed, request_id=request_id or routed.request_id, principal=principal)
            decision = self.policy.decide(routed)
            pool = decision.pool
            self.metrics.decided(decision)
            return self.dispatcher.start(routed, decision, on_delta)
        except Exception as exc:
            self.metrics.failed(pool, exc)
            raise


def _abandoned(outcome: asyncio.Future[RoutedResult]) -> None:
    """Read the outcome of a flight nobody awaits any more, so asyncio does not report its error as lost."""
    if not outcome.cancelled():
        outcome.exception()


def _last_chunk(result: RoutedResult) -> RoutedChunk:
    return RoutedChunk(delta="", finish_reason=result.finish_reason, decision=result.decision, result=result)


def _gathered(outcomes: list[Any], return_exceptions: bool) -> list[RoutedResult | Exception]:
    if not return_exceptions:
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
    return outcomes

"""The Python SDK: ``Router`` takes OpenAI chat-completions arguments and returns results that carry their decision.

``complete``/``acomplete``/``stream``/``astream`` generate; ``route`` only decides (a dry run: no model is
loaded); ``map``/``amap`` run an agent's fan-out of subtasks concurrently and return results in input order.

Arguments: see :mod:`router.request`. In short, every chat-completions argument that changes the output is
honoured; ``model`` (``dspark-router/auto``, ``dspark-router/<pool>``), ``metadata`` (``route``, ``tenant``,
``tags``) and ``user`` (the tenant when metadata has none) steer routing; OpenAI arguments the backends cannot
honour are accepted at their no-op value (``n=1``, ``presence_penalty=0``, ...) and refused by name otherwise.
``stream=True`` makes ``complete``/``acomplete`` return the chunk iterator, as the OpenAI client does.
"""

from __future__ import annotations

import asyncio
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
from router.feeds import AsyncFeed, Feed
from router.metrics import RouterMetrics
from router.policy import Policy
from router.pools import InProcessPool, Pool, wait_result
from router.records import DecisionLog
from router.request import parse_openai_args

if TYPE_CHECKING:
    from classifiers import Scorer


class _Scorer(Enum):
    FROM_CONFIG = "from-config"


FROM_CONFIG = _Scorer.FROM_CONFIG


class Router:
    """Routes each request to a pool by its policy and runs it there.

    ``scorer`` overrides the config's classifier (any object with ``score(request_dict) -> float``, and
    optionally the ``threshold`` it routes at; ``None`` for none). ``pools`` replaces the in-process pools with
    other :class:`~router.pools.Pool` implementations, one per pool the config declares.
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
        self.pools: dict[str, Pool] = dict(
            pools or {n: InProcessPool.from_config(n, c) for n, c in config.pools.items()}
        )
        self.policy = Policy(config.policy, scorer)
        self.metrics = RouterMetrics()
        self.metrics.watch(self.pools)
        self.log = DecisionLog.from_config(config.log, config.redis_url)
        self.dispatcher = Dispatcher(
            self.pools,
            config.policy.overflow,
            config.policy.fallback,
            self.metrics,
            self.log,
            speed_pair=(config.policy.dspark_pool, config.policy.standard_pool),
        )
        self._pool_names = frozenset(self.pools)

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

    def route(self, **args: Any) -> Decision:
        """The decision for these arguments, without generating: nothing is counted, logged or loaded."""
        routed = parse_openai_args(args, self._pool_names)
        return self.dispatcher.preview(self.policy.decide(routed))

    @overload
    def complete(self, *, stream: Literal[False] = False, **args: Any) -> RoutedResult: ...

    @overload
    def complete(self, *, stream: Literal[True], **args: Any) -> Iterator[RoutedChunk]: ...

    def complete(self, *, stream: bool = False, **args: Any) -> RoutedResult | Iterator[RoutedChunk]:
        if stream:
            return self.stream(**args)
        flight = self._start(args)
        return wait_result(flight.outcome, flight.budget_s, f"pool {flight.decision.pool!r}")

    @overload
    async def acomplete(self, *, stream: Literal[False] = False, **args: Any) -> RoutedResult: ...

    @overload
    async def acomplete(self, *, stream: Literal[True], **args: Any) -> AsyncIterator[RoutedChunk]: ...

    async def acomplete(self, *, stream: bool = False, **args: Any) -> RoutedResult | AsyncIterator[RoutedChunk]:
        if stream:
            return self.astream(**args)
        flight = self._start(args)
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(flight.outcome)), flight.budget_s)
        except asyncio.TimeoutError:  # not yet the builtin TimeoutError on Python 3.10
            raise PoolTimeoutError(f"pool {flight.decision.pool!r} gave no answer in {flight.budget_s:g}s") from None

    def stream(self, **args: Any) -> Iterator[RoutedChunk]:
        """Chunks with their decision; the last carries the whole result. Leaving the loop early stops decoding."""
        feed: Feed[tuple[str, Decision]] = Feed()
        flight = self._start({**args, "stream": True}, on_delta=lambda delta, decision: feed.put((delta, decision)))
        for delta, decision in feed.drain(flight.outcome, flight.budget_s, f"pool {flight.decision.pool!r}"):
            yield RoutedChunk(delta=delta, decision=decision)
        yield _last_chunk(flight.outcome.result())

    async def astream(self, **args: Any) -> AsyncIterator[RoutedChunk]:
        feed: AsyncFeed[tuple[str, Decision]] = AsyncFeed()
        flight = self._start({**args, "stream": True}, on_delta=lambda delta, decision: feed.put((delta, decision)))
        async for delta, decision in feed.drain(flight.outcome, flight.budget_s, f"pool {flight.decision.pool!r}"):
            yield RoutedChunk(delta=delta, decision=decision)
        yield _last_chunk(flight.outcome.result())

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

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.log.close()

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _start(self, args: dict[str, Any], on_delta: OnDelta | None = None) -> Flight:
        """Parse, decide and admit; a failure here (bad request, no place, full queues) is raised to the caller."""
        pool = "none"
        try:
            routed = parse_openai_args(args, self._pool_names)
            decision = self.policy.decide(routed)
            pool = decision.pool
            self.metrics.decided(decision)
            return self.dispatcher.start(routed, decision, on_delta)
        except Exception as exc:
            self.metrics.failed(pool, exc)
            raise


def _last_chunk(result: RoutedResult) -> RoutedChunk:
    return RoutedChunk(delta="", finish_reason=result.finish_reason, decision=result.decision, result=result)


def _gathered(outcomes: list[Any], return_exceptions: bool) -> list[RoutedResult | Exception]:
    if not return_exceptions:
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
    return outcomes

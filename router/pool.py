"""The pool interface the router talks to, apart from the pools that implement it.

:class:`Pool` is the seam: ``submit`` admits a request or refuses it at once (never blocks, so a full pool can be
spilled elsewhere), ``depth``/``capacity`` say how full it is and ``load`` how busy, for load-aware routing.
``complete`` and ``stream`` are built on ``submit`` here, once, so an implementation (threads in this process,
:mod:`router.pools`; a Redis-distributed pool, :mod:`router.redis_pool`) only has to provide ``submit``,
``depth``, ``capacity``, ``load`` and ``close``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, TypeVar

from backends.types import GenerationRequest, GenerationResult, StreamChunk
from router.errors import PoolTimeoutError
from router.feeds import Feed
from router.load import PoolLoad

if TYPE_CHECKING:
    from backends.engine import StepRecord

OnChunk = Callable[[StreamChunk], None]
T = TypeVar("T")
WAIT_GRACE_S = 5.0


class Pool(ABC):
    name: str
    kind: str
    timeout_s: float

    @abstractmethod
    def submit(self, request: GenerationRequest, on_chunk: OnChunk | None = None) -> Future[GenerationResult]:
        """Admit the request or raise :class:`QueueFullError` at once. ``on_chunk`` sees every chunk as it is made,
        in a worker; if it raises, generation stops and the future fails with that exception."""

    @property
    @abstractmethod
    def depth(self) -> int:
        """Requests admitted and not finished: queued plus running."""

    @property
    @abstractmethod
    def capacity(self) -> int:
        """The depth at which ``submit`` refuses."""

    @abstractmethod
    def load(self) -> PoolLoad:
        """How busy the pool is right now; cheap enough to read on every routing decision."""

    @abstractmethod
    def close(self) -> None:
        """Refuse new requests and drop queued ones; running ones finish on their own."""

    def warmup(self) -> None:  # noqa: B027 - optional: pools with nothing to preload keep this no-op
        """Load what can be loaded before the first request, so its latency is not the model's load time."""

    def cache_bytes(self) -> dict[str, int]:
        """What the pool's caches hold in this process, by cache (:data:`backends.types.CACHES`); pools whose
        backends run elsewhere (Redis workers, remote engines) hold none here."""
        return {}

    def observe(self, observer: Callable[[StepRecord], None]) -> None:  # noqa: B027 - only batching pools report
        """Have ``observer`` see every batched forward pass of this pool's local backends (for metrics)."""

    @property
    def full(self) -> bool:
        return self.depth >= self.capacity

    def complete(self, request: GenerationRequest) -> GenerationResult:
        return wait_result(self.submit(request), self.timeout_s + WAIT_GRACE_S, f"pool {self.name!r}")

    def stream(self, request: GenerationRequest) -> Iterator[StreamChunk]:
        """Chunks as the worker makes them; leaving the loop early stops the generation."""
        feed: Feed[StreamChunk] = Feed()
        future = self.submit(request.model_copy(update={"stream": True}), on_chunk=feed.put)
        yield from feed.drain(future, self.timeout_s + WAIT_GRACE_S, f"pool {self.name!r}")


def wait_result(future: Future[T], timeout_s: float, source: str) -> T:
    """The future's result, or :class:`PoolTimeoutError` if even the worker's own deadline did not end it."""
    try:
        return future.result(timeout=timeout_s)
    except FutureTimeout:  # not yet the builtin TimeoutError on Python 3.10
        raise PoolTimeoutError(f"{source} gave no answer within {timeout_s:g}s") from None

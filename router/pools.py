"""Worker pools: a bounded queue and a fixed number of workers in front of one kind of backend.

:class:`InProcessPool` implements :class:`~router.pool.Pool` with worker threads in this process. Each worker
is one replica of the model with its own batching loop (:mod:`backends.engine`), which decodes up to
``max_batch`` requests at once; a request goes to the replica with the fewest in flight. Replicas load on first
use: start-up stays fast, dry-run routing never loads a model, and a model that cannot load fails the requests
that need it (and can fall back) rather than the whole router. The pool consumes the backend's stream even for
plain completions, which lets it enforce the pool's timeout between forward passes and stop decoding the moment
a stream's consumer goes away.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from backends.errors import BackendError, DSparkRouterError, ModelLoadError
from backends.protocol import Backend
from backends.threads import on_own_thread
from backends.types import GenerationRequest, GenerationResult, StreamChunk
from router.config import PoolConfig
from router.errors import PoolClosedError, PoolTimeoutError, QueueFullError
from router.load import PoolLoad
from router.pool import OnChunk, Pool

if TYPE_CHECKING:
    from backends.engine import StepRecord
    from backends.local import LocalBackend

SOLO_SMOOTHING = 0.2
"""Weight of the newest one-row forward in a pool's running mean of the tokens a lone request feeds."""


class InProcessPool(Pool):
    def __init__(
        self,
        name: str,
        kind: str,
        load_backend: Callable[[], Backend],
        *,
        workers: int = 1,
        max_batch: int = 1,
        max_queue: int = 32,
        timeout_s: float = 120.0,
    ) -> None:
        self.name, self.kind, self.timeout_s = name, kind, timeout_s
        self.workers, self.max_batch = workers, max_batch
        self._load_backend = load_backend
        self._capacity = workers * max_batch + max_queue
        self._depth = 0
        self._closed = False
        self._lock = threading.Lock()
        self._replicas: list[Backend | None] = [None] * workers
        self._in_flight = [0] * workers
        self._loading = [threading.Lock() for _ in range(workers)]
        self._observers: list[Callable[[StepRecord], None]] = [self._count_solo_step]
        self._solo_tokens: float | None = None
        self._executor = ThreadPoolExecutor(max_workers=workers * max_batch, thread_name_prefix=f"pool-{name}")

    @classmethod
    def from_config(cls, name: str, config: PoolConfig) -> InProcessPool:
        return cls(
            name,
            config.backend,
            lambda: load_backend(config),
            workers=config.workers,
            max_batch=config.max_batch,
            max_queue=config.max_queue,
            timeout_s=config.timeout_s,
        )

    @property
    def depth(self) -> int:
        return self._depth

    @property
    def capacity(self) -> int:
        return self._capacity

    def load(self) -> PoolLoad:
        """Lock-free reads of counters the pool keeps anyway: a decision never waits for a worker."""
        return PoolLoad(
            depth=self._depth,
            running=sum(self._in_flight),
            workers=self.workers,
            max_batch=self.max_batch,
            solo_tokens_per_forward=self._solo_tokens,
            draft_s=next((getattr(r, "draft_s", 0.0) for r in self._replicas if r is not None), 0.0),
        )

    def submit(self, request: GenerationRequest, on_chunk: OnChunk | None = None) -> Future[GenerationResult]:
        with self._lock:
            if self._closed:
                raise PoolClosedError(f"pool {self.name!r} is closed")
            if self._depth >= self._capacity:
                raise QueueFullError(f"pool {self.name!r} is full ({self._depth} of {self._capacity} admitted)")
            self._depth += 1
            future = self._executor.submit(self._run, request, on_chunk, time.monotonic() + self.timeout_s)
        future.add_done_callback(self._release_cancelled)
        return future

    def warmup(self) -> None:
        for replica in range(self.workers):
            self._replica(replica)

    @property
    def replicas(self) -> list[Backend]:
        """The workers' backends loaded so far."""
        return [backend for backend in self._replicas if backend is not None]

    def cache_bytes(self) -> dict[str, int]:
        held: Counter[str] = Counter()
        for backend in self.replicas:  # local backends keep caches; a remote engine's client keeps none
            held.update(backend.cache_bytes() if hasattr(backend, "cache_bytes") else {})
        return dict(held)

    def observe(self, observer: Callable[[StepRecord], None]) -> None:
        self._observers.append(observer)
        for backend in self._replicas:
            _attach(backend, observer)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _count_solo_step(self, record: StepRecord) -> None:
        """A running mean of the tokens one request alone fed a forward: batched rows are cut short by the
        verification budget, so only one-row passes say what a request verifies when nothing competes."""
        if record.rows == 1:
            last = self._solo_tokens
            self._solo_tokens = record.tokens if last is None else last + SOLO_SMOOTHING * (record.tokens - last)

    def _release(self) -> None:
        with self._lock:
            self._depth -= 1

    def _release_cancelled(self, future: Future[GenerationResult]) -> None:
        """A request cancelled in the queue (the pool closing) never ran, so nothing else releases it."""
        if future.cancelled():
            self._release()

    def _replica(self, index: int) -> Backend:
        """Worker ``index``'s backend, loaded by the first request that needs it (the others wait for it)."""
        with self._loading[index]:
            if self._replicas[index] is None:
                backend = self._load()
                for observer in self._observers:
                    _attach(backend, observer)
                self._replicas[index] = backend
            return self._replicas[index]

    def _load(self) -> Backend:
        """On a thread of its own: a worker or the warming thread lives on, and a torch op left there would slow
        transformers' engine (:mod:`backends.threads`)."""
        try:
            return on_own_thread(self._load_backend)
        except DSparkRouterError:
            raise
        except Exception as exc:
            raise ModelLoadError(f"pool {self.name!r} cannot load its backend: {exc}", param="model") from exc

    def _run(self, request: GenerationRequest, on_chunk: OnChunk | None, deadline: float) -> GenerationResult:
        """One admitted request, released from the pool's depth before its future completes: a done-callback runs
        after the caller's wait returns, so a caller holding the result could still see the request counted."""
        try:
            return self._serve(request, on_chunk, deadline)
        finally:
            self._release()

    def _serve(self, request: GenerationRequest, on_chunk: OnChunk | None, deadline: float) -> GenerationResult:
        if time.monotonic() >= deadline:
            raise PoolTimeoutError(f"pool {self.name!r}: spent its {self.timeout_s:g}s timeout in the queue")
        with self._lock:
            index = min(range(self.workers), key=self._in_flight.__getitem__)
            self._in_flight[index] += 1
        try:
            return self._generate(self._replica(index), request, on_chunk, deadline)
        finally:
            with self._lock:
                self._in_flight[index] -= 1

    def _generate(
        self, backend: Backend, request: GenerationRequest, on_chunk: OnChunk | None, deadline: float
    ) -> GenerationResult:
        chunks = backend.stream(request)
        try:
            while True:
                chunk = self._next(chunks)
                if chunk.result is None and time.monotonic() >= deadline:
                    raise PoolTimeoutError(f"pool {self.name!r} did not finish within {self.timeout_s:g}s")
                if on_chunk is not None:
                    on_chunk(chunk)
                if chunk.result is not None:
                    return chunk.result
        finally:
            chunks.close()

    def _next(self, chunks: Iterator[StreamChunk]) -> StreamChunk:
        """The backend's next chunk; its failures become typed errors, so only this request fails."""
        try:
            return next(chunks)
        except StopIteration:
            raise BackendError(f"pool {self.name!r}: the backend's stream ended without a result") from None
        except DSparkRouterError:
            raise
        except Exception as exc:
            raise BackendError(f"pool {self.name!r}: {type(exc).__name__}: {exc}") from exc


def _attach(backend: Backend | None, observer: Callable[[StepRecord], None]) -> None:
    """Local backends batch in an engine that reports its steps; remote ones batch out of sight."""
    engine = getattr(backend, "engine", None)
    if engine is not None:
        engine.observers.append(observer)


def load_backend(config: PoolConfig) -> Backend:
    """A fresh backend for one worker, ready for a structured request; torch and litellm are imported only for the
    pools that need them."""
    if config.local:
        backend = _local_backend(config)
        backend.prepare_grammars()
        return backend
    from router.litellm_backend import LiteLLMBackend

    return LiteLLMBackend(config.model, api_base=config.api_base, api_key=config.api_key, timeout_s=config.timeout_s)


def _local_backend(config: PoolConfig) -> LocalBackend:
    if config.backend == "autoregressive":
        from backends.autoregressive import AutoregressiveBackend

        return AutoregressiveBackend.from_pretrained(
            config.model, device=config.device, dtype=config.dtype, limits=batch_limits(config), threads=config.threads
        )
    from backends.dspark.backend import DSparkBackend

    backend = DSparkBackend.from_pretrained(
        config.model,
        device=config.device,
        dtype=config.dtype,
        drafter=config.drafter,
        drafter_path=config.drafter_path,
        limits=batch_limits(config),
        threads=config.threads,
        traffic=config.traffic,
    )
    return backend.with_options(config.decoding)


def batch_limits(config: PoolConfig):
    """A local backend's batch: the pool admits at most ``max_batch`` per worker, so the engine's own queue only
    holds requests waiting for room in the KV cache."""
    from backends.engine import BatchLimits

    return BatchLimits(
        max_batch=config.max_batch,
        max_kv_tokens=config.max_kv_tokens,
        max_queue=config.max_batch + config.max_queue,
        prefix_cache_mb=config.prefix_cache_mb,
    )

"""A pool whose workers are ``dspark-router worker`` processes on other hosts, reached through Redis Streams.

``submit`` adds the job to the pool's stream and follows the job's reply stream in a thread of its own, turning
chunks into the same ``on_chunk`` calls and future an in-process pool makes, so the dispatcher, the SDK and the
gateway cannot tell the two apart: spill, fallback, streaming and cancellation work unchanged. A caller that
gives up (its ``on_chunk`` raises, or the pool's timeout passes) sets the job's cancel key, which stops the
worker's decoding. A job whose caller does not stream gets no chunks from its worker, only its answer, so while its
reply stream stays silent ``on_chunk`` is called with an empty chunk each read, for the caller to give up on.

Redis being unreachable is bounded: every call has ``connect_timeout_s``, so a new request gets a
:class:`~router.errors.PoolUnavailableError` (503) at once instead of hanging, and redis-py reconnects by itself
when Redis is back. Depth, capacity and load are read from Redis, so every router replica sees the same numbers;
the workers' heartbeats change only every ``heartbeat_s``, so they are read at most every ``CAPACITY_CACHE_S``.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from concurrent.futures import Future

import redis

from backends.types import GenerationRequest, GenerationResult, StreamChunk
from router.config import PoolConfig
from router.errors import PoolClosedError, PoolTimeoutError, PoolUnavailableError, QueueFullError
from router.load import PoolLoad
from router.pool import OnChunk, Pool
from router.redis_jobs import Job, PoolKeys, WorkerLoad, error_from_payload, reproducible

READ_BLOCK_MS = 1000
SILENT_READ_MS = 100
"""How long a read of a job that does not stream waits: its worker sends nothing until the answer, so this is how
soon the pool notices its caller gave up."""
CAPACITY_CACHE_S = 0.25


class RedisPool(Pool):
    def __init__(self, name: str, config: PoolConfig) -> None:
        if config.redis_url is None:
            raise ValueError(f"pool {name!r} has transport redis but no redis_url")
        self.name, self.kind, self.timeout_s = name, config.backend, config.timeout_s
        self.settings = config.redis
        self.keys = PoolKeys(config.redis.prefix, name)
        self._max_queue = config.max_queue
        self._max_batch = config.max_batch
        self._url = config.redis_url
        timeout = self.settings.connect_timeout_s
        self._client = redis.Redis.from_url(self._url, socket_connect_timeout=timeout, socket_timeout=timeout)
        # Blocking reads hold their connection for READ_BLOCK_MS, so they get a pool and a socket timeout of their own.
        self._reader = redis.Redis.from_url(
            self._url, socket_connect_timeout=timeout, socket_timeout=timeout + READ_BLOCK_MS / 1000
        )
        self._closed = False
        self._workers_cache: tuple[float, list[WorkerLoad]] = (-CAPACITY_CACHE_S, [])

    @property
    def depth(self) -> int:
        """Jobs in the stream: waiting, or running on a worker (a finished job's entry is deleted)."""
        try:
            return self.depth_now()
        except redis.RedisError:
            return 0

    @property
    def capacity(self) -> int:
        """``max_queue`` plus the concurrency of the workers that sent a heartbeat lately."""
        return self._max_queue + sum(load.concurrency for load in self._recent_workers())

    def load(self) -> PoolLoad:
        """The stream's length now, and the running jobs and batch size the live workers last reported."""
        workers = self._recent_workers()
        return PoolLoad(
            depth=self.depth,
            running=sum(worker.running for worker in workers),
            workers=len(workers),
            max_batch=max((worker.concurrency for worker in workers), default=self._max_batch),
        )

    def _recent_workers(self) -> list[WorkerLoad]:
        """:meth:`live_workers`, read at most every ``CAPACITY_CACHE_S``; none while Redis is unreachable."""
        stamp, workers = self._workers_cache
        if time.monotonic() - stamp < CAPACITY_CACHE_S:
            return workers
        try:
            workers = self.live_workers()
        except redis.RedisError:
            workers = []
        self._workers_cache = (time.monotonic(), workers)
        return workers

    def live_workers(self) -> list[WorkerLoad]:
        """The workers whose last heartbeat is recent, with the load each reported."""
        since = time.time() - 3 * self.settings.heartbeat_s
        ids = self._client.zrangebyscore(self.keys.workers, since, "+inf")
        loads = self._client.hmget(self.keys.load, ids) if ids else []
        return [WorkerLoad.model_validate_json(load) for load in loads if load is not None]

    def serving(self) -> bool:
        """Whether any worker sent a heartbeat lately (False while Redis is unreachable): the pool's health cools
        it down only when none does, so that a worker killed mid-job costs its own requests, not the pool."""
        return bool(self._recent_workers())

    def available(self) -> bool:
        try:
            return bool(self._client.ping())
        except redis.RedisError:
            return False

    def submit(self, request: GenerationRequest, on_chunk: OnChunk | None = None) -> Future[GenerationResult]:
        if self._closed:
            raise PoolClosedError(f"pool {self.name!r} is closed")
        job = Job(id=uuid.uuid4().hex, request=reproducible(request), deadline=time.time() + self.timeout_s)
        try:
            depth, capacity = self.depth_now(), self.capacity
            if depth >= capacity:
                raise QueueFullError(f"pool {self.name!r} is full ({depth} of {capacity} admitted)")
            self._client.xadd(self.keys.jobs, {"job": job.model_dump_json()})
        except redis.RedisError as exc:
            raise PoolUnavailableError(f"pool {self.name!r}: Redis is unreachable ({exc})") from None
        future: Future[GenerationResult] = Future()
        future.set_running_or_notify_cancel()  # running from now on: the caller stops it through on_chunk
        threading.Thread(
            target=self._follow, args=(job, on_chunk, future), name=f"redis-{self.name}-{job.id[:8]}", daemon=True
        ).start()
        return future

    def depth_now(self) -> int:
        """The depth, raising when Redis cannot say (``depth`` reports 0 then, for metrics)."""
        return int(self._client.xlen(self.keys.jobs))

    def close(self) -> None:
        self._closed = True

    def _follow(self, job: Job, on_chunk: OnChunk | None, future: Future[GenerationResult]) -> None:
        """Read the job's reply stream until its final entry; chunks a restarted job sends again are skipped."""
        reply, last_id, delivered = self.keys.reply(job.id), "0-0", 0
        deadline = time.monotonic() + self.timeout_s
        try:
            while True:
                if time.monotonic() > deadline:
                    raise PoolTimeoutError(f"pool {self.name!r} did not finish within {self.timeout_s:g}s")
                read = self._read(reply, last_id, READ_BLOCK_MS if job.request.stream else SILENT_READ_MS)
                if not read and on_chunk is not None:  # nothing new: the caller may have gone (a job that does
                    on_chunk(StreamChunk(delta=""))  # not stream sends nothing until its answer)
                for _, entries in read:
                    for entry_id, fields in entries:
                        last_id = entry_id
                        if b"error" in fields:
                            future.set_exception(error_from_payload(fields[b"error"]))
                            return
                        if b"result" in fields:
                            result = GenerationResult.model_validate_json(fields[b"result"])
                            if on_chunk is not None:
                                on_chunk(StreamChunk(delta="", finish_reason=result.finish_reason, result=result))
                            future.set_result(result)
                            return
                        seq = int(fields[b"seq"])
                        if seq < delivered:
                            continue
                        delivered = seq + 1
                        if on_chunk is not None:
                            on_chunk(StreamChunk(delta=fields[b"delta"].decode()))
        except BaseException as exc:  # the caller gave up, timed out or lost Redis: the worker should stop
            self._cancel(job)
            future.set_exception(exc)

    def _read(self, reply: str, last_id: str, block_ms: int) -> list:
        try:
            return self._reader.xread({reply: last_id}, block=block_ms, count=256) or []
        except redis.RedisError as exc:
            raise PoolUnavailableError(f"pool {self.name!r}: lost Redis while waiting for the reply ({exc})") from None

    def _cancel(self, job: Job) -> None:
        with contextlib.suppress(redis.RedisError):  # Redis is gone: the job's deadline stops the worker instead
            self._client.set(self.keys.cancel(job.id), 1, ex=int(self.settings.reply_ttl_s))

"""The wire format of Redis pools, shared by the router side (``router/redis_pool.py``) and the workers
(``router/worker.py``): key names, the job message, reply entries and typed errors.

Everything distributed rides on Redis Streams and consumer groups, so nothing here is a protocol of our own:

Keys start with the pool's ``redis.prefix`` (``dspark-router``), so deployments can share one Redis:

* ``<prefix>:<pool>:jobs``: one entry per job, read by the consumer group ``workers``. A worker acknowledges
  and deletes the entry only after the job's final reply is written, so the stream's length is the pool's
  depth (waiting plus running) as every router replica sees it, and a job whose worker died stays pending
  until another worker claims it (``XAUTOCLAIM`` past the visibility timeout).
* ``<prefix>:<pool>:dead``: jobs delivered ``max_deliveries`` times without finishing.
* ``<prefix>:<pool>:workers`` (sorted set: worker id -> last heartbeat) and ``<prefix>:<pool>:load`` (hash: worker
  id -> running and concurrency): who is alive and how busy, for capacity and load-aware routing.
* ``<prefix>:reply:<job>``: the job's chunks (``seq``, ``delta``) and then one final entry (``result`` or
  ``error``); it expires ``reply_ttl_s`` after its last write, so an abandoned reply cleans itself up.
* ``<prefix>:cancel:<job>``: set by a caller that gave up (client gone, timeout); the worker stops decoding.

Chunks are numbered so that a job restarted on another worker, which regenerates the same text (see
:func:`reproducible`), is delivered to the caller once: seq numbers already seen are skipped.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

from pydantic import BaseModel

import router.errors  # noqa: F401 - defines the router's error classes, so they are found as subclasses
from backends.errors import BackendError, DSparkRouterError
from backends.types import GenerationRequest

GROUP = "workers"


@dataclass(frozen=True)
class PoolKeys:
    prefix: str
    pool: str

    @property
    def jobs(self) -> str:
        return f"{self.prefix}:{self.pool}:jobs"

    @property
    def dead(self) -> str:
        return f"{self.prefix}:{self.pool}:dead"

    @property
    def workers(self) -> str:
        return f"{self.prefix}:{self.pool}:workers"

    @property
    def load(self) -> str:
        return f"{self.prefix}:{self.pool}:load"

    @property
    def traffic(self) -> str:
        """The answers the pool's workers wrote, which each one's traffic cache takes in (router/traffic_share.py)."""
        return f"{self.prefix}:{self.pool}:traffic"

    def reply(self, job_id: str) -> str:
        return f"{self.prefix}:reply:{job_id}"

    def cancel(self, job_id: str) -> str:
        return f"{self.prefix}:cancel:{job_id}"


class WorkerLoad(BaseModel):
    """What a worker reports with each heartbeat."""

    running: int
    concurrency: int


class Job(BaseModel):
    id: str
    request: GenerationRequest
    deadline: float  # unix time: a job reclaimed after it has passed is answered with a timeout, not run


def reproducible(request: GenerationRequest) -> GenerationRequest:
    """The request with a seed pinned when it samples without one.

    Decoding is a deterministic function of the request and its seed on a given model, dtype and device, so a
    job restarted on another worker regenerates exactly the text the dead worker had streamed: greedy needs no
    seed, seeded sampling replays the same draws, and an unseeded sampled request gets its seed here, before
    it is queued, so it is seeded on every delivery.
    """
    if request.greedy or request.seed is not None:
        return request
    return request.model_copy(update={"seed": secrets.randbits(62)})


def _error_classes(base: type[DSparkRouterError]) -> dict[str, type[DSparkRouterError]]:
    found = {base.__name__: base}
    for sub in base.__subclasses__():
        found.update(_error_classes(sub))
    return found


def error_payload(error: BaseException) -> str:
    if isinstance(error, DSparkRouterError):
        return json.dumps({"type": type(error).__name__, "message": error.message, "param": error.param})
    return json.dumps({"type": "BackendError", "message": f"{type(error).__name__}: {error}", "param": None})


def error_from_payload(payload: str | bytes) -> DSparkRouterError:
    """The worker's typed error, as the same class on the caller's side (a bad schema stays a 400)."""
    data = json.loads(payload)
    cls = _error_classes(DSparkRouterError).get(data.get("type"), BackendError)
    # The message is final already, and some classes build theirs from other arguments (ConfigError): so the
    # base initialiser sets it, whatever the class's own signature.
    error = cls.__new__(cls)
    DSparkRouterError.__init__(error, data.get("message", ""), param=data.get("param"))
    return error

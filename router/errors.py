"""The router's own typed errors, on the shared :class:`~backends.errors.DSparkRouterError` base.

Each one says what went wrong where a caller (or the gateway, through ``to_openai()``) can act on it: a config
key to fix, a queue that is full right now, a pool that ran out of time.
"""

from __future__ import annotations

from backends.errors import BackendError, DSparkRouterError, InvalidRequestError
from backends.errors import QueueFullError as QueueFullError  # pools and a backend's batch raise the same one


class ConfigError(DSparkRouterError):
    """An invalid router config; ``param`` is the dotted key path of the offending entry."""

    error_type = "config_error"

    def __init__(self, key: str, message: str, *, source: str | None = None) -> None:
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{key}: {message}" if key else f"{where}{message}", param=key or None)


class RoutingError(InvalidRequestError):
    """The policy could not place the request: no rule matched, no classifier, no default pool."""


class ModelNotFoundError(InvalidRequestError):
    """``model`` names neither ``auto`` nor a pool: OpenAI's 404, so clients report a wrong model name as such."""

    status_code = 404
    code = "model_not_found"


class PoolTimeoutError(BackendError):
    """A pool did not finish the request within its ``timeout_s`` (queue wait included)."""

    error_type = "timeout_error"
    status_code = 504


class PoolClosedError(BackendError):
    """A request reached a pool after :meth:`Router.close`."""


class StreamClosed(DSparkRouterError):
    """The consumer of a stream went away; raised inside the worker to stop decoding early."""

    error_type = "stream_closed"


class PoolUnavailableError(BackendError):
    """A pool's transport (its Redis) cannot be reached right now: retry later; in-process pools still serve."""

    error_type = "service_unavailable"
    status_code = 503

    def __init__(self, message: str, *, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        """When a cooled-down pool takes requests again (the gateway's ``Retry-After``); None when unknown."""


class WorkerLostError(BackendError):
    """The worker running this request died and no other worker could finish it in its place.

    It fails this one request and never counts against the pool's health: the pool's other workers serve, and a
    pool cooled down for one worker's death would refuse every request they could answer."""

    code = "worker_lost"


class ReplayDivergedError(WorkerLostError):
    """A restarted job regenerated text that differs from what its first worker streamed (different hardware or
    model files): sending more would corrupt the caller's text, so the job fails instead."""

    code = "replay_diverged"


class JobDeadLetteredError(WorkerLostError):
    """A job was delivered to workers ``max_deliveries`` times and never finished (each worker died on it); it is
    kept in the pool's dead-letter stream instead of being retried forever."""

    code = "dead_lettered"

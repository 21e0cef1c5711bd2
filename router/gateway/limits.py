"""What a request must pass before it reaches the router: its key, its key's rate, the body cap, a free slot.

* **API keys** are bearer tokens, from the config and ``api_keys_env``. The presented token is compared with every
  key, through SHA-256 digests and :func:`hmac.compare_digest`, so neither the time taken nor an early exit says
  how much of a guess was right or which key it was close to.
* **Rates** are a token bucket per key: ``requests_per_minute`` refill evenly over the minute, and a key that was
  quiet may spend up to a minute's worth at once. An empty bucket is a 429 whose ``Retry-After`` is the wait for
  the next token. With a top-level ``redis_url`` the buckets live in Redis (one atomic script, on Redis's clock),
  so a key's rate holds across every gateway replica; if Redis cannot be reached, each replica falls back to its
  own bucket rather than refuse or wave through every request.
* **The body cap** is checked against ``Content-Length`` before anything is read, and again while reading (a
  chunked body has no length), so an oversized body is never kept; the rest of it is read and dropped, within
  bounds, so that a client still writing it gets the 413 rather than a reset connection.
* **Concurrency**: at most ``max_concurrency`` completions are handed to the router at once and at most
  ``max_waiting`` more wait for a slot; beyond that the gateway answers 429 at once instead of queueing
  without bound. The pools' own queues still apply behind it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import redis
from starlette.requests import Request

from router.gateway.disconnect import ClientGone
from router.gateway.errors import AuthenticationError, PayloadTooLargeError, RateLimitError
from router.gateway.settings import ApiKey


@dataclass
class TokenBucket:
    per_minute: int
    tokens: float = field(init=False)
    updated: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.tokens = float(self.per_minute)

    def take(self, now: float) -> float | None:
        """Spend one token; None if there was one, else the seconds until there is."""
        rate = self.per_minute / 60.0
        self.tokens = min(float(self.per_minute), self.tokens + (now - self.updated) * rate)
        self.updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return None
        return (1.0 - self.tokens) / rate


# KEYS[1]: the key's bucket; ARGV[1]: requests per minute. Returns the seconds to wait, "0" when a token was taken.
_TAKE = """
local per_minute = tonumber(ARGV[1])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1e6
local state = redis.call('HMGET', KEYS[1], 'tokens', 'updated')
local tokens = tonumber(state[1]) or per_minute
local updated = tonumber(state[2]) or now
local rate = per_minute / 60
tokens = math.min(per_minute, tokens + math.max(0, now - updated) * rate)
local wait = 0
if tokens >= 1 then tokens = tokens - 1 else wait = (1 - tokens) / rate end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'updated', tostring(now))
redis.call('EXPIRE', KEYS[1], 120)
return tostring(wait)
"""


class SharedRates:
    """Token buckets in Redis, shared by the gateway replicas; named by a digest of the key, never the key."""

    def __init__(self, url: str, prefix: str = "dspark-router") -> None:
        self.client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
        self.prefix = prefix
        self._take = self.client.register_script(_TAKE)

    def take(self, digest: bytes, per_minute: int) -> float | None:
        """Like :meth:`TokenBucket.take`; raises :class:`redis.RedisError` when Redis cannot say."""
        wait = float(self._take(keys=[f"{self.prefix}:ratelimit:{digest.hex()[:32]}"], args=[per_minute]))
        return wait if wait > 0 else None


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


class KeyGuard:
    """Who may call the API and how often. With no keys configured everyone may, without a rate."""

    def __init__(self, keys: list[ApiKey], shared: SharedRates | None = None) -> None:
        self._keys = [(key, _digest(key.key.get_secret_value().encode())) for key in keys]
        self._buckets = {id(key): TokenBucket(key.requests_per_minute) for key in keys if key.requests_per_minute}
        self._shared = shared

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def admit(self, request: Request) -> ApiKey | None:
        """The key the request presents, once it is known and within its rate; raises 401 or 429 otherwise."""
        if not self._keys:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise AuthenticationError("missing API key: send it as 'Authorization: Bearer <key>'")
        # Header values arrive decoded as latin-1; encoding them back gives the bytes the client sent.
        presented = _digest(token.strip().encode("latin-1"))
        found = None
        for key, digest in self._keys:
            if hmac.compare_digest(presented, digest) and found is None:
                found = key
        if found is None:
            raise AuthenticationError("incorrect API key")
        wait = self._wait(found, presented)
        if wait is not None:
            raise RateLimitError(
                f"key {found.label!r} is over its {found.requests_per_minute} requests per minute",
                retry_after_s=max(1, math.ceil(wait)),
            )
        return found

    def _wait(self, key: ApiKey, digest: bytes) -> float | None:
        bucket = self._buckets.get(id(key))
        if bucket is None:
            return None
        if self._shared is not None:
            with contextlib.suppress(redis.RedisError):
                return self._shared.take(digest, key.requests_per_minute)
        return bucket.take(time.monotonic())


LINGER_BYTES = 128 << 20
"""The most of a refused body read and dropped so that its client hears the 413 (nginx's lingering close)."""
LINGER_S = 10.0
"""The longest a refused body is drained: a client that trickles its bytes is not waited for."""


async def read_body(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        await _linger(request, int(declared))
        raise PayloadTooLargeError(f"the body is {int(declared)} bytes; the limit is {max_bytes}")
    parts, size, more = [], 0, True
    while more:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise ClientGone("the client disconnected while sending its body")
        part, more = message.get("body", b""), message.get("more_body", False)
        size += len(part)
        if size > max_bytes:
            if more:
                await _linger(request, None)
            raise PayloadTooLargeError(f"the body is over the limit of {max_bytes} bytes")
        parts.append(part)
    return b"".join(parts)


async def _linger(request: Request, declared: int | None) -> None:
    """Read and drop the rest of a refused body, within bounds, before answering.

    Clients that write their whole body before reading (urllib, curl without ``Expect``) otherwise see a
    connection reset instead of the 413: the server would close with their bytes still unread. A body declared
    past :data:`LINGER_BYTES` is not drained at all, and none is drained past it or past :data:`LINGER_S`.
    """
    if declared is not None and declared > LINGER_BYTES:
        return
    drained, deadline = 0, time.monotonic() + LINGER_S
    while drained <= LINGER_BYTES:
        try:
            message = await asyncio.wait_for(request.receive(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            return
        if message["type"] == "http.disconnect" or not message.get("more_body", False):
            return
        drained += len(message.get("body", b""))


class ConcurrencyLimit:
    """At most ``limit`` holders at once and ``max_waiting`` in line; the rest are refused with a 429."""

    def __init__(self, limit: int, max_waiting: int) -> None:
        self.limit, self.max_waiting = limit, max_waiting
        self.running = 0
        self.waiting = 0
        self._slots = asyncio.Semaphore(limit)

    async def acquire(self) -> None:
        if self._slots.locked() and self.waiting >= self.max_waiting:
            raise RateLimitError(
                f"the gateway is busy: {self.running} completions running and {self.waiting} waiting for a slot"
            )
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1

    def release(self) -> None:
        self.running -= 1
        self._slots.release()

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        await self.acquire()
        try:
            yield
        finally:
            self.release()

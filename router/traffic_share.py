"""One traffic cache across a pool's Redis workers: each worker publishes the answers it writes on the pool's traffic
stream, and every other worker inserts them into its own caches; a new or restarted worker warms from the stream's
recent history before it serves.

So a request that lands on worker B drafts from the answer worker A wrote for the request before it, as it would
on one machine. The stream is only ever a hint: a message lost (Redis down, a worker killed before it published) costs
acceptance, never correctness, since every draft is verified. Entries carry the answer's scope (its tenant, within
its API key), which the receiving worker keeps: isolation holds across workers as within one.
"""

from __future__ import annotations

import json
import logging
import threading
from array import array

import redis

from backends.dspark.traffic import TrafficCaches

log = logging.getLogger(__name__)

STREAM_LENGTH = 20_000
"""Answers the stream keeps (approximately: Redis trims whole nodes), which a new worker warms from."""


class TrafficShare:
    """Publishes what ``caches`` record here, and inserts what the pool's other workers publish."""

    def __init__(
        self, client: redis.Redis, stream: str, origin: str, caches: TrafficCaches, block_ms: int, retry_s: float
    ) -> None:
        """``block_ms``, ``retry_s``: how long a read waits for new answers (within the client's socket timeout) and
        how long to wait after Redis failed, as the worker's own reads do."""
        self.client, self.stream, self.origin, self.caches = client, stream, origin, caches
        self.block_ms, self.retry_s = block_ms, retry_s
        self._stop = threading.Event()
        self._reader: threading.Thread | None = None

    def start(self) -> None:
        """Warm from the stream's history, then publish and follow it."""
        last = self._warm()
        self.caches.listeners.append(self._publish)
        self._reader = threading.Thread(target=self._follow, args=(last,), name="traffic-share", daemon=True)
        self._reader.start()

    def stop(self) -> None:
        self._stop.set()
        if self._publish in self.caches.listeners:
            self.caches.listeners.remove(self._publish)
        if self._reader is not None:
            self._reader.join(timeout=self.block_ms / 1000 + 5)

    def _publish(self, scope: str | None, answer: list[int]) -> None:
        fields = {"origin": self.origin, "scope": json.dumps(scope), "tokens": array("i", answer).tobytes()}
        try:
            self.client.xadd(self.stream, fields, maxlen=STREAM_LENGTH, approximate=True)
        except redis.RedisError as exc:  # a lost answer costs acceptance only
            log.warning("traffic share: could not publish an answer (%s)", exc)

    def _insert(self, fields: dict[bytes, bytes]) -> None:
        if fields.get(b"origin", b"").decode() == self.origin:
            return
        tokens = array("i")
        tokens.frombytes(fields[b"tokens"])
        self.caches.insert(json.loads(fields[b"scope"]), tokens.tolist())

    def _warm(self) -> str:
        """Every answer the stream still holds; the id to follow it from."""
        last = "0-0"
        try:
            for entry_id, fields in self.client.xrange(self.stream, "-", "+"):
                self._insert(fields)
                last = entry_id.decode()
        except redis.RedisError as exc:
            log.warning("traffic share: could not read the history (%s); starting cold", exc)
            return "$"
        return last

    def _follow(self, last: str) -> None:
        while not self._stop.is_set():
            try:
                read = self.client.xread({self.stream: last}, count=100, block=self.block_ms)
            except redis.RedisError as exc:
                log.warning("traffic share: Redis unreachable (%s); retrying", exc)
                self._stop.wait(self.retry_s)
                continue
            for _, entries in read or []:
                for entry_id, fields in entries:
                    self._insert(fields)
                    last = entry_id.decode()

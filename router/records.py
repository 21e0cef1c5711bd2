"""The decision log: every finished request as one JSON record, to a JSON-lines file and/or a Redis stream.

A log write never fails a request: the answer is already computed, so a full disk or a Redis outage costs the
record (with a warning), not the user's result.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Protocol

from router.config import LogConfig
from router.decisions import RouteRecord

log = logging.getLogger(__name__)


class RecordSink(Protocol):
    def write(self, record: RouteRecord) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def write(self, record: RouteRecord) -> None:
        line = record.model_dump_json() + "\n"
        with self._lock, self.path.open("a", encoding="utf-8") as file:
            file.write(line)

    def close(self) -> None:
        """Each write opens and closes the file, so there is nothing to flush."""


class RedisStreamSink:
    """XADD ``record=<json>`` to a capped stream; ``calibrate --from-log`` reads it with XRANGE."""

    def __init__(self, url: str, stream: str, maxlen: int) -> None:
        import redis

        self.client = redis.Redis.from_url(url)
        self.stream = stream
        self.maxlen = maxlen

    def write(self, record: RouteRecord) -> None:
        self.client.xadd(self.stream, {"record": record.model_dump_json()}, maxlen=self.maxlen, approximate=True)

    def close(self) -> None:
        self.client.close()


class DecisionLog:
    def __init__(self, sinks: list[RecordSink], include_request: bool = True) -> None:
        self.sinks = sinks
        self.include_request = include_request

    @classmethod
    def from_config(cls, config: LogConfig, redis_url: str | None) -> DecisionLog:
        sinks: list[RecordSink] = []
        if config.jsonl:
            sinks.append(JsonlSink(config.jsonl))
        if config.redis_stream and redis_url:
            sinks.append(RedisStreamSink(redis_url, config.redis_stream, config.redis_maxlen))
        return cls(sinks, config.include_request)

    def write(self, record: RouteRecord) -> None:
        if not self.include_request:
            record = record.model_copy(update={"request": None})
        for sink in self.sinks:
            try:
                sink.write(record)
            except Exception as exc:
                log.warning("decision log %s failed: %s", type(sink).__name__, exc)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()

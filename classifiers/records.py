"""Measured subtasks: one record format for the calibration's measurements and the router's traffic log.

The classifier learns from both the same way (a request and the speedup DSpark had on it), so
``classifiers/data/measurements.jsonl`` and the router's log share :class:`Measurement`: ``calibrate --from-log``
reads either. The router's log may hold fields this module does not know; they are ignored, so the router can
log more than the classifier needs without breaking retraining.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, ValidationError

from backends.errors import DSparkRouterError

Split = Literal["train", "val", "test"]
REDIS_SCHEMES = ("redis", "rediss", "unix")
_REDIS_BATCH = 1000


class RecordSourceError(DSparkRouterError, ValueError):
    """A measurements file or log stream that cannot be read."""

    error_type = "invalid_request_error"
    status_code = 400


class Measurement(BaseModel):
    """One subtask and how much faster DSpark served it than the standard pool.

    ``request``: the chat-completions body as the client sent it.
    ``speedup``: DSpark tokens/s over standard tokens/s on this request, which is standard wall time over DSpark
    wall time when both produce the same output (greedy, exact verification). None when the request ran on one
    pool only; such records are kept in logs but not learnt from.
    ``decision``: what the router chose, e.g. ``{"pool": "dspark", "rule": "classifier", "score": 0.93}``;
    kept for analysis, not learnt from.
    ``stats``: free-form timings. ``calibrate`` writes ``{"dspark": {...}, "standard": {...}}``, each with
    ``wall_time_s``, ``tokens_per_s``, ``completion_tokens``, ``forward_passes``, ``finish_reason``, and for
    DSpark ``mean_accepted`` and ``same_output`` (its tokens equal the standard pool's).
    ``split``: train/val/test; records without one (live traffic) get a stable one from a hash of the request.
    ``kind`` and ``template``: the synthetic subtask's origin (:mod:`backends.corpus.subtasks`), when there is one.
    ``machine``: the key of the machine the speedup was measured on (:func:`backends.dspark.profile.machine_key`):
    speedups hold for the machine's cost curve, and a router elsewhere scales them by its own.
    """

    model_config = ConfigDict(extra="ignore")

    request: dict[str, Any]
    speedup: float | None = None
    decision: dict[str, Any] | None = None
    stats: dict[str, Any] = {}
    split: Split | None = None
    kind: str | None = None
    template: str | None = None
    machine: str | None = None

    @property
    def resolved_split(self) -> Split:
        """The record's split, or 70/15/15 by a CRC of the canonical request: the same request always lands in the
        same split, so retraining on a growing log never moves a record from test into train."""
        if self.split is not None:
            return self.split
        bucket = zlib.crc32(self.canonical_request().encode()) % 100
        return "train" if bucket < 70 else "val" if bucket < 85 else "test"

    @property
    def group(self) -> str:
        """What cross-validation holds out together: the template, or for live traffic the request itself, so no
        fold is scored on a subtask it was fitted on."""
        return self.template or self.canonical_request()

    def canonical_request(self) -> str:
        return json.dumps(self.request, sort_keys=True, default=str)

    @property
    def standard_time_s(self) -> float | None:
        """The standard pool's wall time, when the stats hold it: the weight of this record in time saved."""
        standard = self.stats.get("standard")
        value = standard.get("wall_time_s") if isinstance(standard, dict) else None
        return float(value) if isinstance(value, (int, float)) else None


def write_measurements(records: Iterable[Measurement], path: str | Path, append: bool = False) -> Path:
    """One line per record, flushed as each arrives: a long calibration stopped half-way keeps its measurements,
    and ``append`` resumes it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a" if append else "w", encoding="utf-8") as f:
        for record in records:
            f.write(record.model_dump_json(exclude_none=True) + "\n")
            f.flush()
    return path


def is_redis_url(source: str) -> bool:
    return urlsplit(source).scheme in REDIS_SCHEMES


def _decode(raw: str | dict[str, bytes]) -> Any:
    """A JSON line, or a stream entry: the record as JSON in its ``record`` field, or one JSON value per field."""
    if isinstance(raw, str):
        return json.loads(raw)
    if "record" in raw:
        return json.loads(raw["record"])
    return {key: json.loads(value) for key, value in raw.items()}


def _parse(lines: Iterable[tuple[str, str | dict[str, bytes]]]) -> tuple[list[Measurement], list[str]]:
    """Valid records, and one note per line that is not (live logs may hold a few; they must not stop retraining)."""
    records, rejected = [], []
    for where, raw in lines:
        try:
            records.append(Measurement.model_validate(_decode(raw)))
        except (ValueError, ValidationError) as exc:
            rejected.append(f"{where}: {str(exc).splitlines()[0]}")
    return records, rejected


def _file_lines(path: Path) -> Iterator[tuple[str, str]]:
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                yield f"{path.name}:{number}", line


def _stream_entries(url: str, stream: str | None) -> Iterator[tuple[str, dict[str, bytes]]]:
    """XRANGE over the whole stream, in batches so a long log never sits in one reply."""
    import redis

    parts = urlsplit(url)
    name = stream or parts.fragment
    if not name:
        raise RecordSourceError(f"no stream named: give it as {url}#STREAM or with --stream", param="stream")
    client = redis.Redis.from_url(urlunsplit(parts._replace(fragment="")))
    start = "-"
    try:
        while batch := client.xrange(name, min=start, max="+", count=_REDIS_BATCH):
            for entry_id, fields in batch:
                yield entry_id.decode(), {key.decode(): value for key, value in fields.items()}
            start = f"({batch[-1][0].decode()}"
    except redis.RedisError as exc:
        raise RecordSourceError(f"cannot read stream {name!r} from {parts.netloc}: {exc}", param="from_log") from exc


def read_measurements(source: str | Path, stream: str | None = None) -> tuple[list[Measurement], list[str]]:
    """Records from a JSONL file or a Redis stream (``redis://host:port/db#stream``), and notes on rejected lines."""
    if is_redis_url(str(source)):
        return _parse(_stream_entries(str(source), stream))
    path = Path(source)
    if not path.is_file():
        raise RecordSourceError(f"no measurements file at {str(path)!r}", param="from_log")
    return _parse(_file_lines(path))

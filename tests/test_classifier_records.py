"""Measurement records: the calibration's JSONL and the router's log, from a file or a Redis stream."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import redis

from classifiers import records as records_module
from classifiers.records import Measurement, RecordSourceError, read_measurements, write_measurements

ROUTER_LOG_LINE = {
    "request": {"messages": [{"role": "user", "content": "Extract the city: Ann lives in Oslo."}], "temperature": 0},
    "decision": {"pool": "dspark", "rule": "score", "score": 0.91},
    "stats": {"mean_accepted": 2.7, "tokens_per_s": 410.0},
    "speedup": 1.8,
    "trace_id": "a field the classifier does not know",
}


def test_jsonl_round_trip_and_rejected_lines_are_reported(tmp_path):
    records = [Measurement(request={"messages": []}, speedup=1.2, split="val", kind="k", template="k/t")]
    path = write_measurements(records, tmp_path / "m.jsonl")
    with path.open("a") as f:
        f.write(json.dumps(ROUTER_LOG_LINE) + "\n\nnot json\n" + json.dumps({"speedup": 2.0}) + "\n")
    read, rejected = read_measurements(path)
    assert read[0] == records[0]
    assert read[1].speedup == 1.8 and read[1].decision["pool"] == "dspark" and read[1].split is None
    assert [note.split(":")[1] for note in rejected] == ["4", "5"]


def test_records_without_a_split_get_a_stable_one_from_the_request():
    records = [Measurement(request={"messages": [{"role": "user", "content": f"task {i}"}]}) for i in range(2000)]
    shares = Counter(record.resolved_split for record in records)
    assert 0.65 < shares["train"] / 2000 < 0.75 and 0.1 < shares["test"] / 2000 < 0.2
    again = [Measurement(request=record.request) for record in records]
    assert [r.resolved_split for r in again] == [r.resolved_split for r in records]
    assert Measurement(request={}, split="test").resolved_split == "test"


def test_standard_time_is_read_from_the_calibration_stats():
    assert Measurement(request={}, stats={"standard": {"wall_time_s": 0.5}}).standard_time_s == 0.5
    assert Measurement(request={}, stats={"standard": "?"}).standard_time_s is None


def test_a_missing_file_is_a_typed_error(tmp_path):
    with pytest.raises(RecordSourceError, match="no measurements file"):
        read_measurements(tmp_path / "missing.jsonl")


def test_redis_stream_entries_in_either_shape(redis_url, monkeypatch):
    monkeypatch.setattr(records_module, "_REDIS_BATCH", 3)  # several XRANGE pages
    client = redis.Redis.from_url(redis_url)
    client.delete("router-log")
    client.xadd("router-log", {"record": json.dumps(ROUTER_LOG_LINE)})
    client.xadd("router-log", {key: json.dumps(value) for key, value in ROUTER_LOG_LINE.items()})
    client.xadd("router-log", {"record": "{broken"})
    for i in range(5):
        client.xadd("router-log", {"record": json.dumps({**ROUTER_LOG_LINE, "speedup": float(i)})})
    records, rejected = read_measurements(f"{redis_url}#router-log")
    assert [r.speedup for r in records] == [1.8, 1.8, 0.0, 1.0, 2.0, 3.0, 4.0]
    assert len(rejected) == 1
    same, _ = read_measurements(redis_url, stream="router-log")
    assert same == records


def test_a_redis_url_needs_a_stream_name(redis_url):
    with pytest.raises(RecordSourceError, match="no stream named"):
        read_measurements(redis_url)

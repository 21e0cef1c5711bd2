"""``bench soak`` runs end to end on tiny models for three quarters of a minute, both faults included, and keeps
its hard invariants: no request lost or answered twice, no 5xx but the typed 503s of the Redis outage. Latency
and memory are reported, not asserted: benchmarks measure, tests check that they can."""

from __future__ import annotations

import json

import pytest

from benchmarks import report as benchmarks_report
from benchmarks.soak_clients import KINDS
from router.cli import main


@pytest.mark.slow
def test_a_short_soak_loses_and_duplicates_nothing_through_both_faults(tmp_path, capsys):
    out, png = tmp_path / "soak.json", tmp_path / "soak.png"
    argv = ["bench", "soak", "--minutes", "0.75", "--capacity-s", "5", "--outage-s", "3", "--sample-s", "2"]
    assert main([*argv, "--json", str(out), "--plot", str(png)]) == 0
    report = json.loads(out.read_text())
    assert png.stat().st_size > 0
    assert report["lost"] == 0 and report["duplicated"] == 0, report["examples"]
    assert [f["fault"] for f in report["faults"]] == ["redis_restart", "worker_kill"]
    assert report["exit_codes"]["worker-0"] == -9
    assert set(report["by_kind"]) == set(KINDS) and report["capacity_rps"] > 0
    assert report["rate_rps"] == pytest.approx(0.8 * report["capacity_rps"])
    assert report["bucket_s"] == 10 and len(report["latency"]) == 5
    assert any(b["p99_ms"] for b in report["latency"])
    seen = {label for sample in report["rss"] for label in sample["rss_mb"]}
    assert {"gateway", "worker-0", "worker-1", "redis-0", "redis-1"} <= seen
    assert set(report["met"]) == {"lost", "duplicated", "server_errors", "rss_growth", "p99_drift"}
    printed = capsys.readouterr().out
    assert "lost 0, duplicated 0" in printed
    assert max(map(len, printed.splitlines())) <= 80
    assert report["server_errors"] == 0, report["errors_by_status"]
    section = benchmarks_report.soak(report, tmp_path, tmp_path)  # as BENCHMARKS.md shows it
    assert "bench soak --minutes 0.75" in section and "![latency and RSS over the soak](soak.png)" in section
    assert "| requests lost | 0 | 0 | yes |" in section

"""``bench gateway`` runs end to end on the tiny models and reports every measurement (timings are not asserted:
benchmarks measure, tests check that they can)."""

# ruff: noqa: F811 - the shared fixtures are imported by name and then requested as arguments

from __future__ import annotations

import json

from router.cli import main
from tests.test_gateway_support import RULES, router_models  # noqa: F401
from tests.test_router_support import config_data, write_config


def test_bench_gateway_reports_both_sides_and_the_load(tmp_path, router_models, capsys):
    config = write_config(tmp_path / "router.yaml", config_data(router_models, rules=RULES))
    out = tmp_path / "gateway.json"
    argv = ["bench", "gateway", "--config", str(config), "--requests", "6", "--clients", "4", "--seconds", "0.5"]
    assert main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    for part in ("completion", "route", "ttft"):
        assert report[part]["calls"] == 6
        assert report[part]["gateway"]["p50_ms"] > 0 and report[part]["in_process"]["p50_ms"] > 0
    load = report["route_throughput"]
    assert load["requests"] > 0 and load["non_200"] == 0
    assert set(report["met"]) == {"added_p50_ms", "added_p99_ms", "route_requests_per_s"}
    printed = capsys.readouterr().out
    assert "short greedy completion p50" in printed and "keep-alive clients" in printed
    assert max(map(len, printed.splitlines())) <= 80

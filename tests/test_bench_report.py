"""``bench all`` and BENCHMARKS.md: the suite names real benchmarks with arguments they accept, and the shipped
document is exactly what the shipped results render to."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks import BENCHMARKS, report, suite

REPO = Path(__file__).resolve().parents[1]


def test_every_suite_step_parses_with_its_benchmarks_own_arguments(tmp_path):
    for step in suite.SUITE:
        assert step.subcommand() in BENCHMARKS and step.subcommand() != "all"
        parser = argparse.ArgumentParser()
        BENCHMARKS[step.subcommand()].fill(parser)
        args = parser.parse_args(step.argv(tmp_path))
        assert Path(args.json) == tmp_path / f"{step.name}.json"
        assert step.command().startswith(f"dspark-router bench {step.subcommand()} ")
    assert len({step.name for step in suite.SUITE}) == len(suite.SUITE)
    assert {name for name, _, _ in report.SECTIONS} == {step.name for step in suite.SUITE}


def test_the_shipped_benchmarks_md_is_what_the_shipped_results_render():
    """Edit the results (by running the benchmarks) and re-render, never the document by hand."""
    results = REPO / "benchmarks" / "results"
    runs = json.loads((results / suite.SUITE_FILE).read_text())
    assert set(runs["benchmarks"]) == {step.name for step in suite.SUITE}
    assert report.render(results, runs, REPO) == (REPO / "BENCHMARKS.md").read_text()


def test_a_missing_result_is_named_not_fatal(tmp_path):
    text = report.render(tmp_path, {}, tmp_path)
    for name, title, _ in report.SECTIONS:
        assert f"## {title}" in text and f"No `{name}.json` in this run." in text


def test_a_section_says_when_it_was_measured_on_other_weights_than_the_shipped_ones(tmp_path):
    def run(weights: str) -> dict:
        entry = {"command": "dspark-router bench quality", "seconds": 60.0, "finished": "now", "weights": weights}
        return {"benchmarks": {"quality": entry}}

    shipped = report.weights_id()
    assert shipped is not None, "the shipped model has weights"
    current = report.render(tmp_path, run(shipped), tmp_path)
    assert f"(1.0 min, now, weights `{shipped}`)" in current and "earlier weights" not in current
    stale = report.render(tmp_path, run("0" * 12), tmp_path)
    assert "earlier weights" in stale and "bench all --only quality" in stale

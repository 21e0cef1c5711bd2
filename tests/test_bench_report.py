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
        assert step.name in BENCHMARKS and step.name != "all"
        parser = argparse.ArgumentParser()
        BENCHMARKS[step.name].add_arguments(parser)
        args = parser.parse_args(step.argv(tmp_path))
        assert Path(args.json) == tmp_path / f"{step.name}.json"
        assert step.command().startswith(f"dspark-router bench {step.name} ")


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

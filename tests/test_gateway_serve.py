"""``dspark-router serve`` as a user runs it (a subprocess, through the demo), how it gives up, and the ``route``
command reading the same bodies the gateway takes (inline, from a file, from standard input)."""

# ruff: noqa: F811 - the shared fixtures are imported by name and then requested as arguments

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from router.cli import main
from tests.test_gateway_support import RULES, WEATHER, router_models  # noqa: F401
from tests.test_router_entrypoints import example
from tests.test_router_support import config_data, free_port, write_config


@pytest.fixture
def config(tmp_path, router_models) -> Path:
    return write_config(tmp_path / "router.yaml", config_data(router_models, rules=RULES))


def test_the_demo_runs_through_a_served_gateway(config, capsys, monkeypatch):
    """What `make demo` runs: serve in a subprocess on a free port, the agent's subtasks over HTTP, serve stopped."""
    monkeypatch.setenv("COLUMNS", "200")
    assert example("agent_pipeline").main(["--gateway", "--config", str(config), "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    for label in ("tool-call arguments", "json extraction", "code", "summary", "story", "through the gateway at"):
        assert label in out
    assert "tools" in out and "structured" in out  # the rules that placed them, read from the responses


def test_serve_exits_when_the_models_cannot_load(tmp_path, router_models, capsys):
    """In-process (the demo test runs the real subprocess): a server that can never be ready stops, status 1."""
    data = config_data(router_models)
    data["pools"]["dspark"]["model"] = str(tmp_path)  # a folder, so the config loads, but no model in it
    config = write_config(tmp_path / "r.yaml", data)
    assert main(["serve", "--config", str(config), "--port", str(free_port()), "--log-level", "warning"]) == 1
    assert "cannot serve (warm-up failed: ModelLoadError" in capsys.readouterr().err


@pytest.mark.parametrize("source", ["inline", "file", "stdin"])
def test_route_reads_the_gateway_body_inline_from_a_file_or_stdin(config, tmp_path, capsys, monkeypatch, source):
    body = json.dumps(
        {"model": "dspark-router/auto", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}
    )
    argument = {"inline": body, "file": str(tmp_path / "body.json"), "stdin": "-"}[source]
    (tmp_path / "body.json").write_text(body)
    monkeypatch.setattr(sys, "stdin", io.StringIO(body))
    assert main(["route", "--config", str(config), "--request", argument]) == 0
    assert json.loads(capsys.readouterr().out)["rule"] == "tools"


def test_route_names_a_request_it_cannot_read(config, tmp_path, capsys):
    assert main(["route", "--config", str(config), "--request", str(tmp_path / "missing.json")]) == 2
    error = json.loads(capsys.readouterr().err)["error"]
    assert error["param"] == "request" and "neither a JSON object nor a readable file" in error["message"]

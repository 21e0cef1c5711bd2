"""The ``route`` CLI command and the two examples, run in-process against tiny-model configs."""

# ruff: noqa: F811 - the shared fixtures are imported by name and then requested as arguments

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from router.cli import main
from tests.test_router_support import config_data, router_models, write_config  # noqa: F401

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
RULES = [{"name": "tools", "pool": "dspark", "match": {"tools": True}}]


def example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def config(tmp_path, router_models) -> Path:
    return write_config(tmp_path / "router.yaml", config_data(router_models, rules=RULES))


def test_route_prints_the_decision(config, capsys):
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert main(["route", "--config", str(config), "--request", json.dumps({"tools": tools}), "hello"]) == 0
    decision = json.loads(capsys.readouterr().out)
    assert (decision["pool"], decision["rule"]) == ("dspark", "tools")


def test_route_generate_prints_the_routed_result(config, capsys):
    assert main(["route", "--config", str(config), "--generate", "--max-tokens", "3", "hello"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["decision"]["pool"] == "standard" and result["usage"]["completion_tokens"] <= 3


@pytest.mark.parametrize(("argv", "param"), [(["--request", "{oops"], "request"), ([], "messages")])
def test_route_refuses_bad_input_as_json_errors(config, capsys, argv, param):
    assert main(["route", "--config", str(config), *argv]) == 2
    assert json.loads(capsys.readouterr().err)["error"]["param"] == param


def test_agent_pipeline_example(config, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert example("agent_pipeline").main(["--config", str(config), "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    for label in ("tool-call arguments", "code", "summary", "story", "5 subtasks"):
        assert label in out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "tool-call arguments  " in out  # no column squeezed to an ellipsis at 80 columns


def test_agent_pipeline_reports_a_missing_model(tmp_path, router_models, capsys):
    data = config_data(router_models)
    data["pools"]["dspark"]["model"] = str(tmp_path / "not-trained-yet")
    assert example("agent_pipeline").main(["--config", str(write_config(tmp_path / "r.yaml", data))]) == 2
    assert "pools.dspark.model" in capsys.readouterr().out


def test_the_example_shows_the_speedup_that_decided_a_load_aware_route():
    """Under ``time_saved`` a request expected to gain 1.30x alone may still go to the standard pool when DSpark's
    batch is full; the table must show the 0.95x that sent it there, not the 1.30x that did not decide."""
    from router.decisions import Decision, PoolSeen

    seen = {
        "dspark": PoolSeen(depth=16, running=16, workers=1, max_batch=16, batch=16, speedup=0.95, expected_s=3.0),
        "standard": PoolSeen(depth=0, running=0, workers=1, max_batch=16, batch=1, expected_s=2.0),
    }
    loaded = Decision(
        pool="standard", policy_pool="standard", rule="time_saved", reason="", expected_speedup=1.3, load=seen
    )
    assert example("agent_pipeline").decision_cell(loaded) == "expects 0.95x"
    scored = Decision(pool="dspark", policy_pool="dspark", rule="classifier", reason="", score=0.5)
    assert example("agent_pipeline").decision_cell(scored) == "score 0.50"

"""The console command, run as a user runs it: a real subprocess of the installed entry point."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def _cli(*args: str) -> subprocess.CompletedProcess:
    """The console script installed beside this interpreter (a venv's bin/), as a user would run it."""
    script = Path(sys.executable).with_name("dspark-router")
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "router"]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def model(tiny_model_paths):
    return str(tiny_model_paths["llama"])


def test_generate_json_prints_the_result_fields(model):
    proc = _cli("generate", "--model", model, "--max-tokens", "6", "--temperature", "0", "--json", "def f(")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["finish_reason"] == "length"
    assert result["usage"]["completion_tokens"] == len(result["token_ids"]) == 6
    assert result["stats"]["forward_passes"] == 6


def test_generate_text_matches_json_text(model):
    args = ("generate", "--model", model, "--max-tokens", "8", "--temperature", "0.9", "--seed", "4", "x = ")
    text = _cli(*args).stdout
    as_json = json.loads(_cli(*args, "--json").stdout)
    assert text == as_json["text"] + "\n"


def test_bad_input_exits_2_with_an_openai_shaped_error(model, tmp_path):
    proc = _cli("generate", "--model", model, "--max-tokens", "0", "x")
    assert proc.returncode == 2
    assert json.loads(proc.stderr)["error"]["param"] == "max_tokens"
    proc = _cli("generate", "--model", str(tmp_path / "missing"), "x")
    assert proc.returncode == 2
    assert json.loads(proc.stderr)["error"]["type"] == "model_load_error"


def test_generate_with_the_dspark_backend_decodes_with_its_drafter(model, tmp_path):
    """``--backend dspark`` runs the published drafter's loop with the drafter named by ``--drafter-path`` (its
    statistics have one slot per block position), greedy output token for token the plain decoder's; a model
    with no drafter is a typed error, not silent plain decoding. Whether a round drafts is the scheduler's call
    from measured costs (on a target as small as this one's drafter it rarely pays), so it is not asserted."""
    from backends.dspark.drafter_config import DEFAULT_BLOCK_SIZE, DRAFTER_DIR
    from backends.loading import load_model
    from tests.test_dspark_drafter import perturbed_drafter

    perturbed_drafter(load_model(model)).save(tmp_path / "drafters" / DRAFTER_DIR)
    args = ("generate", "--model", model, "--max-tokens", "24", "--temperature", "0", "--json", "def f(")
    plain = json.loads(_cli(*args).stdout)
    proc = _cli(*args, "--backend", "dspark", "--drafter-path", str(tmp_path / "drafters"))
    assert proc.returncode == 0, proc.stderr
    drafted = json.loads(proc.stdout)
    assert drafted["token_ids"] == plain["token_ids"]
    spans = drafted["stats"]["spans"]
    assert spans is not None and len(spans["acceptance_by_offset"]) == DEFAULT_BLOCK_SIZE, "not the drafter's loop"
    proc = _cli(*args, "--backend", "dspark")
    assert proc.returncode == 2 and json.loads(proc.stderr)["error"]["type"] == "model_load_error"

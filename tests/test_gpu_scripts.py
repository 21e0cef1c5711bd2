"""The GPU machine's two commands, run dry on the CPU with a tiny model, so they stay working between the rare runs
on a GPU: every stage ends, writes what the machine would send back (at most 8 files, each under 16 MiB, named as
the device tool returns them), and the cargo of wheels and GGUF pieces puts the file back together."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from backends.convert import convert, sha256_of
from backends.dspark.drafter_config import DRAFTER_DIR
from backends.loading import load_model
from backends.modelfactory import build_model
from benchmarks.gpu import cargo
from benchmarks.gpu.stages import LOG, SUMMARY
from benchmarks.gpu.train import join
from tests.test_convert import write_gguf
from tests.test_dspark_drafter import perturbed_drafter

REPO = Path(__file__).resolve().parents[1]
RETURNED = 8
"""Files the machine sends back at most."""


@pytest.fixture(scope="module")
def tiny_gguf(tiny_tokenizer, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gpu") / "tiny.gguf"
    write_gguf(build_model("llama", tiny_tokenizer, seed=3), tiny_tokenizer, path, gguf.GGMLQuantizationType.Q8_0)
    return path


def _run(module: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *argv], cwd=REPO, capture_output=True, text=True, timeout=600)


def _returned(results: Path) -> dict:
    files = sorted(p for p in results.rglob("*") if p.is_file())
    assert len(files) <= RETURNED and all(p.stat().st_size < 16 * 2**20 for p in files), files
    assert all(p.parent == results for p in files), "the machine returns files two folders down at most"
    assert (results / LOG).read_text()
    return json.loads((results / SUMMARY).read_text())["stages"]


def test_serve_and_measure_runs_dry_on_the_cpu(tiny_gguf, tmp_path):
    model = convert(tiny_gguf, tmp_path / "model")
    perturbed_drafter(load_model(model)).save(model / DRAFTER_DIR)  # the model's own drafters, as drafters_for says
    results = tmp_path / "out"
    argv = ["--device", "cpu", "--gguf", str(tiny_gguf), "--model", str(model), "--budget", "400"]
    argv += ["--per-category", "1", "--max-tokens", "8", "--concurrency", "1,2", "--window", "0.5"]
    done = _run("benchmarks.gpu.serve", str(results), *argv)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    stages = _returned(results)
    assert list(stages) == ["preflight", "model", "cost_curve", "decode", "batching"]
    assert all(stage["exit_code"] == 0 for stage in stages.values()), stages
    decode = json.loads((results / "decode.json").read_text())
    assert decode["sets"] and json.loads((results / "dspark_sps.json").read_text())
    assert json.loads((results / "batching.json").read_text())


def test_train_runs_dry_on_the_cpu_and_its_drafter_comes_back_whole(tiny_gguf, tmp_path):
    model = convert(tiny_gguf, tmp_path / "model")
    results = tmp_path / "out"
    argv = ["--device", "cpu", "--gguf", str(tiny_gguf), "--model", str(model), "--budget", "400", "--fresh"]
    argv += ["--work", str(tmp_path / "work"), "--corpus", str(tmp_path / "no-corpus")]
    argv += ["--subtasks", "12", "--stdlib", "0", "--synthesised", "0", "--follow-ups", "0", "--max-tokens", "16"]
    argv += ["--heads-steps", "4", "--positions", "32", "--dspark-steps", "4", "--batch-size", "3", "--anchors", "4"]
    argv += ["--draft-layers", "1", "--markov-rank", "16", "--warmup", "1", "--vocab-size", "64"]
    done = _run("benchmarks.gpu.train", str(results), *argv)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    stages = _returned(results)
    assert [stages[s]["exit_code"] for s in ("preflight", "model", "train")] == [0, 0, 0], stages
    trained = tmp_path / "work" / "drafters" / DRAFTER_DIR
    joined = join(results, tmp_path / "joined")
    assert (joined / "model.safetensors").read_bytes() == (trained / "model.safetensors").read_bytes()
    assert json.loads((joined / "config.json").read_text()) == json.loads((trained / "config.json").read_text())


def test_the_cargo_fits_each_call_and_puts_the_gguf_back_together(tiny_gguf, tmp_path):
    """Wheels whole and the GGUF in pieces, no folder over its room; unpacked one folder a call, the GGUF is whole
    and checked only once its last piece is in."""
    wheels = [tmp_path / "a-1.0-py3-none-any.whl", tmp_path / "b-1.0-py3-none-any.whl"]
    for wheel in wheels:
        wheel.write_bytes(b"w" * 3000)
    room = 4000
    folders = cargo.pack(wheels, tiny_gguf, room, tmp_path / "cargo")
    assert len(folders) >= 3
    for folder in folders:
        assert sum(p.stat().st_size for p in folder.iterdir() if p.name != cargo.PLAN) <= room
    store = tmp_path / "store"
    for folder in folders:
        for wheel in folder.glob("*.whl"):
            wheel.unlink()  # pip installs real wheels; these stand-ins are not
        state = cargo.unpack(folder, store)
        assert state["gguf"] == (folder == folders[-1])
    assert sha256_of(store / tiny_gguf.name) == sha256_of(tiny_gguf)
    assert cargo.tree_bytes() < cargo.ROOM, "the working tree alone leaves a call no room"

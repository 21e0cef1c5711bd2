"""Training the published drafter on a tiny frozen target: the loss falls, checkpoints resume, STS calibrates."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from backends.dspark.drafter import DSparkDrafter
from backends.dspark.drafter_config import WEIGHTS_FILE
from backends.dspark.drafter_train import DISTILL_FILE, REPORT_FILE, DrafterTrainConfig, calibrate
from backends.dspark.train import CHECKPOINT_DIR
from backends.loading import load_model
from backends.modelfactory import build_model, save_pretrained
from router.cli import main


@pytest.fixture(scope="module")
def sharp_target(tmp_path_factory, tiny_tokenizer):
    """A tiny Qwen3 whose final norm is scaled up: peaked next-token distributions, as a trained model has, so
    acceptance varies from token to token and there is something for the confidence head to predict."""
    model = build_model("qwen3", tiny_tokenizer, seed=11)
    with torch.no_grad():
        model.model.norm.weight.mul_(8.0)
    return save_pretrained(model, tiny_tokenizer, tmp_path_factory.mktemp("sharp") / "target")


@pytest.fixture(scope="module")
def trained(sharp_target, tmp_path_factory):
    """``dspark-router train --drafter dspark`` for 20 steps, as a user runs it."""
    output = tmp_path_factory.mktemp("drafter") / "dspark_drafter"
    config = DrafterTrainConfig(
        target=sharp_target,
        output=output,
        steps=20,
        batch_size=2,
        anchors=4,
        prompts=8,
        distill_tokens=16,
        layers=1,
        markov_rank=16,
        warmup=2,
        lr=3e-3,
        checkpoint_every=10,
    )
    argv = ["train", "--drafter", "dspark", "--model", str(sharp_target), "--output", str(output)]
    argv += ["--steps", "20", "--batch-size", "2", "--anchors", "4", "--self-distill", "8", "--distill-tokens", "16"]
    argv += ["--draft-layers", "1", "--markov-rank", "16", "--warmup", "2", "--lr", "3e-3", "--checkpoint-every", "10"]
    assert main(argv) == 0
    return config


def test_training_lowers_the_loss_and_saves_the_published_layout(trained, sharp_target):
    report = json.loads((trained.output / REPORT_FILE).read_text())
    assert report["final_loss"] < report["first_loss"]
    assert len(report["acceptance_by_position"]) == 7 and len(report["temperatures"]) == 7
    assert {"ece_before", "ece_after"} <= set(report)
    target = load_model(sharp_target).model
    drafter = DSparkDrafter.load(trained.output, target.get_input_embeddings(), target.get_output_embeddings())
    assert drafter.config.confidence_temperatures == report["temperatures"]
    assert json.loads((trained.output / "config.json").read_text())["architectures"] == ["Qwen3DSparkModel"]
    saved = load_file(trained.output / WEIGHTS_FILE)
    assert torch.equal(saved["embed_tokens.weight"], target.get_input_embeddings().weight), "the target stays frozen"
    assert torch.equal(saved["lm_head.weight"], target.get_output_embeddings().weight)


def test_training_resumes_from_its_checkpoint(trained):
    argv = ["train", "--drafter", "dspark", "--model", str(trained.target), "--output", str(trained.output)]
    argv += ["--steps", "24", "--batch-size", "2", "--anchors", "4", "--draft-layers", "1", "--markov-rank", "16"]
    assert main(argv) == 0
    state = torch.load(trained.output / CHECKPOINT_DIR / "trainer_state.pt", weights_only=True)
    assert state["step"] == 24
    assert math.isnan(json.loads((trained.output / REPORT_FILE).read_text())["first_loss"]), "it did not resume"


def test_calibration_lowers_ece_on_held_out_data(trained, sharp_target):
    """An over-confident head (logits four times too large) is what STS exists for: the temperatures it fits on
    one half of the held-out blocks recover the factor, and the ECE of prefix survival on the other half falls."""
    loaded = load_model(sharp_target)
    sequences = [tuple(s) for s in json.loads((trained.output / DISTILL_FILE).read_text())]
    drafter = DSparkDrafter.load(
        trained.output, loaded.model.get_input_embeddings(), loaded.model.get_output_embeddings()
    )
    drafter.config.confidence_temperatures = None
    with torch.no_grad():
        drafter.confidence_head.proj.weight.mul_(4.0)
        drafter.confidence_head.proj.bias.mul_(4.0)
    before, after, temperatures, _ = calibrate(drafter, loaded, sequences, replace(trained, anchors=8))
    assert after < before
    assert all(2.5 < t < 6.0 for t in temperatures)
    assert drafter.config.confidence_temperatures == temperatures

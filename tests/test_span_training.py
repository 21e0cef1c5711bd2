"""Span-heads training data and runs: whole documents per row, prompts out of the loss, a curriculum resumed."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from backends.dspark.corpus import build_corpus, split_chat_document
from backends.dspark.train import CHECKPOINT_DIR, IGNORE, TRAINER_STATE, pack_documents


def test_rows_hold_whole_documents_and_train_only_on_answers(tiny_tokenizer):
    docs = build_corpus(12, seed=0, code_chunks=2, prose_chunks=2)
    rows = pack_documents(docs, tiny_tokenizer, 512, tiny_tokenizer.pad_token_id)
    assert all(ids.shape == labels.shape == (512,) for ids, labels in rows)
    packed = [ids[labels != IGNORE] for ids, labels in rows]
    answers = []
    for doc in docs:
        prompt, answer = split_chat_document(doc)
        answers.append(tiny_tokenizer.encode(answer, add_special_tokens=False)[:512])
        if prompt:
            assert prompt.endswith("<|im_start|>assistant\n") and not answer.startswith("<|im_start|>")
    # Every document's labelled tokens appear whole, in order, inside one row: no answer is cut off its prompt.
    flat = [t for row in packed for t in row.tolist()]
    assert flat == [t for answer in answers for t in answer]
    prompt_tokens = sum(len(tiny_tokenizer.encode(split_chat_document(d)[0], add_special_tokens=False)) for d in docs)
    assert sum(int((labels == IGNORE).sum()) for _, labels in rows) >= prompt_tokens


def test_a_curriculum_stops_at_its_step_and_resumes_on_other_data(tmp_path):
    """Stage one stops at step 3 of a 6-step schedule; stage two resumes there on a mix with copy drills."""
    out = tmp_path / "base"
    common = ["--mode", "scratch", "--output", str(out), "--steps", "6", "--batch-size", "2", "--seq-len", "128"]
    common += ["--context", "256", "--vocab-size", "400", "--hidden", "32", "--layers", "1", "--chat-examples", "30"]
    cli = [sys.executable, "-m", "router", "train", *common]
    first = subprocess.run([*cli, "--stop-at", "3", "--mix", "0.6,0,0.25,0.15"], capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-2000:]
    assert torch.load(out / CHECKPOINT_DIR / TRAINER_STATE, weights_only=True)["step"] == 3
    tokenizer = str(out / CHECKPOINT_DIR)
    second = subprocess.run([*cli, "--tokenizer", tokenizer], capture_output=True, text=True)
    assert second.returncode == 0, second.stderr[-2000:]
    assert torch.load(out / CHECKPOINT_DIR / TRAINER_STATE, weights_only=True)["step"] == 6
    report = json.loads((out / "train_report_scratch.json").read_text())
    assert report["steps"] == 6 and report["base_loss"] > 0
    saved = json.loads((out / CHECKPOINT_DIR / "train_config.json").read_text())
    assert saved["mix"]["drills"] == 0.25

"""Span-heads training data and runs: whole documents per row, prompts out of the loss, a curriculum resumed."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from backends.dspark.corpus import build_corpus, split_chat_document
from backends.dspark.train import (
    CHECKPOINT_DIR,
    IGNORE,
    TRAINER_STATE,
    induction_row,
    pack_documents,
    with_induction_rows,
)


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


def test_a_document_whose_prompt_fills_a_row_is_left_out(tiny_tokenizer):
    """Such a row would have no label: a batch of them gave a NaN loss that poisoned the weights."""
    docs = build_corpus(12, seed=0, code_chunks=0, prose_chunks=0)
    shortest = min(len(tiny_tokenizer.encode(split_chat_document(d)[0], add_special_tokens=False)) for d in docs)
    rows = pack_documents(docs, tiny_tokenizer, shortest + 1, tiny_tokenizer.pad_token_id)
    assert rows and all(bool((labels != IGNORE).any()) for _, labels in rows)


def test_induction_rows_label_only_tokens_a_copy_can_predict(tiny_tokenizer):
    token_ids = torch.arange(3, 400)
    ids, labels = induction_row(256, token_ids, torch.Generator().manual_seed(0))
    assert ids.shape == labels.shape == (256,) and int(ids.min()) >= 3
    targets = (labels != IGNORE).nonzero().flatten().tolist()
    assert len(targets) > 256 // 3
    for t in targets:
        assert labels[t] == ids[t]
        # the token before the target was seen earlier, followed by the target: copying it predicts the target
        before = [s for s in range(t - 1) if ids[s] == ids[t - 1] and ids[s + 1] == ids[t]]
        assert before, f"position {t} cannot be predicted by copying"
    batches = iter([(torch.zeros((4, 64), dtype=torch.long), torch.full((4, 64), IGNORE))])
    ids, labels = next(with_induction_rows(batches, 0.5, tiny_tokenizer, seed=0))
    copied = [bool((labels[r] != IGNORE).any()) for r in range(4)]
    assert copied == [True, True, False, False]
    assert not set(ids[:2].flatten().tolist()) & set(tiny_tokenizer.all_special_ids)


def test_a_curriculum_stops_at_its_step_and_resumes_on_other_data(tmp_path):
    """Stage one stops at step 3 of a 6-step schedule; stage two resumes there on a mix with copy drills, and
    the learning curve carries over."""
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
    assert [point["step"] for point in report["curve"]] == [3, 6], "the learning curve spans both stages"
    assert (out / "train_curve_scratch.png").is_file()
    saved = json.loads((out / CHECKPOINT_DIR / "train_config.json").read_text())
    assert saved["mix"]["drills"] == 0.25


def test_a_base_trained_without_heads_gets_fresh_ones_for_heads_training(tmp_path):
    base, out = tmp_path / "base", tmp_path / "heads"
    common = ["--steps", "2", "--batch-size", "2", "--seq-len", "64"]
    scratch = ["--mode", "scratch", "--output", str(base), "--num-heads", "0", "--induction-rows", "0.5"]
    scratch += ["--context", "128", "--vocab-size", "400", "--hidden", "32", "--layers", "1", "--chat-examples", "20"]
    cli = [sys.executable, "-m", "router", "train"]
    first = subprocess.run([*cli, *scratch, *common], capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-2000:]
    assert json.loads((base / "dspark_config.json").read_text())["num_heads"] == 0
    heads = ["--mode", "heads", "--model", str(base), "--output", str(out)]
    heads += ["--self-distill", "4", "--distill-tokens", "8"]
    second = subprocess.run([*cli, *heads, *common], capture_output=True, text=True)
    assert second.returncode == 0, second.stderr[-2000:]
    assert json.loads((out / "dspark_config.json").read_text())["num_heads"] == 3
    assert len(json.loads((out / "train_report_heads.json").read_text())["head_accuracy"]) == 3

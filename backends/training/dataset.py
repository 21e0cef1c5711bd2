"""The corpus recipe (:mod:`backends.corpus.recipe`) run through the frozen target, stage by stage, resumably.

1. the target writes first user turns (``synthesis.jsonl``);
2. the given prompts and the usable synthesised ones, filtered, are answered (``distill.jsonl``);
3. the target writes a second user turn after the first ``follow_ups`` synthesised conversations
   (``follow_up_synthesis.jsonl``), and those are answered (``follow_ups.jsonl``).

Each stage is a :func:`~backends.training.distill.distill` call (the engine's answers on a CPU, bulk ones on a GPU),
which appends records as they finish and skips
what a file already holds, so an interrupted ``train data`` continues where it stopped. The manifest
(``corpus_manifest.json``) counts every source's prompts made, dropped, kept and answered (a prompt too long for the
model's context is kept but not answered), and their answer tokens.

Answering takes hours on a CPU, so what one machine answered can travel: :func:`ship_corpus` writes a run's stage
files, gzipped, with the recipe and the target they answer, and :func:`start_from` puts them into another run
that follows the same recipe on the same target, which then answers only the rest. The engine's answers do not
depend on the batch or the CPU's instruction set, so they are the answers that run would have made.
"""

from __future__ import annotations

import gzip
import json
import shutil
from dataclasses import asdict
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from backends.corpus.evaluation import EvaluationFilter
from backends.corpus.recipe import (
    MANIFEST_FILE,
    CorpusRecipe,
    Manifest,
    PromptFilter,
    TrainingPrompt,
    conversation_prompts,
    given_prompts,
)
from backends.corpus.synthesis import Conversation, first_turn_requests, follow_up_requests, user_turn
from backends.training.distill import Answers, Distilled, distill, read_distilled

DISTILL_FILE = "distill.jsonl"
SYNTHESIS_FILE = "synthesis.jsonl"
FOLLOW_UP_SYNTHESIS_FILE = "follow_up_synthesis.jsonl"
FOLLOW_UPS_FILE = "follow_ups.jsonl"
STAGE_FILES = (SYNTHESIS_FILE, DISTILL_FILE, FOLLOW_UP_SYNTHESIS_FILE, FOLLOW_UPS_FILE)
SHIPPED_FILE = "shipped.json"
"""A shipped corpus's recipe and target, which a run must share to start from it."""


def build_corpus(
    answers: Answers,
    tokenizer: PreTrainedTokenizerBase,
    recipe: CorpusRecipe,
    run: Path,
    evaluation: EvaluationFilter | None = None,
) -> tuple[list[Distilled], Manifest]:
    """Every answered sequence of the recipe, first turns then follow-ups, and the manifest (also saved)."""
    manifest = Manifest(recipe)
    keep = PromptFilter(evaluation or EvaluationFilter.default(), manifest)

    def text(record: Distilled) -> str:
        return tokenizer.decode(record.completion, skip_special_tokens=True)

    writing = [
        TrainingPrompt(f"write:{d}", r) for d, r in first_turn_requests(tokenizer, recipe.synthesised, recipe.seed)
    ]
    turns = distill(answers, writing, run / SYNTHESIS_FILE)
    synthesised = _conversations(turns, writing, [[] for _ in writing], text, manifest, "synth")
    prompts = keep(given_prompts(recipe) + conversation_prompts(recipe, synthesised, "synth"))
    first = distill(answers, prompts, run / DISTILL_FILE)

    histories = [
        Conversation(prompts[r.index].source.split(":", 1)[1], [_user(prompts[r.index]), _assistant(text(r))])
        for r in first
        if r.source.startswith("synth:")
    ][: recipe.follow_ups]
    requests = follow_up_requests(tokenizer, histories, recipe.seed)
    writing = [TrainingPrompt(f"write:{c.domain}", r) for c, r in zip(histories, requests)]
    turns = distill(answers, writing, run / FOLLOW_UP_SYNTHESIS_FILE)
    follow_ups = _conversations(turns, writing, [h.messages for h in histories], text, manifest, "follow-up")
    second = keep(conversation_prompts(recipe, follow_ups, "follow-up"))
    records = first + distill(answers, second, run / FOLLOW_UPS_FILE)
    for record in records:
        count = manifest.count(record.source)
        count.answered += 1
        count.answer_tokens += len(record.completion)
    manifest.save(run / MANIFEST_FILE)
    return records, manifest


def read_corpus(run: Path) -> list[Distilled] | None:
    """A finished corpus (its manifest is written last) as ``build_corpus`` returned it; None before then."""
    if not (run / MANIFEST_FILE).is_file():
        return None
    return read_distilled(run / DISTILL_FILE) + read_distilled(run / FOLLOW_UPS_FILE)


def _conversations(turns, writing, histories, text, manifest: Manifest, stage: str) -> list[Conversation]:
    """The usable synthesised turns, each appended to the history it was written after (a history too long for
    the context to write after has no turn)."""
    conversations = []
    for record in turns:
        domain, history = writing[record.index].source.split(":", 1)[1], histories[record.index]
        turn = user_turn(text(record))
        if turn is None:
            manifest.unusable[f"{stage}:{domain}"] += 1
        else:
            conversations.append(Conversation(domain, [*history, {"role": "user", "content": turn}]))
    return conversations


def _user(prompt: TrainingPrompt) -> dict[str, str]:
    return {"role": "user", "content": prompt.request.messages[-1].content}


def _assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def ship_corpus(run: Path, recipe: CorpusRecipe, target: str, into: Path) -> dict[str, int]:
    """``run``'s stage files so far, gzipped into ``into`` with the recipe and the target (its GGUF's sha256)
    they answer, and the manifest once the corpus is finished; the records shipped per file. What ``into`` held
    from an earlier shipment and this run lacks is removed: a stale manifest would mark the corpus finished, and a
    run starting from it would never answer the rest (as when a recipe grows)."""
    into.mkdir(parents=True, exist_ok=True)
    shipped = {}
    for name in STAGE_FILES:
        records = read_distilled(run / name)
        if records:
            text = "".join(json.dumps(record.__dict__) + "\n" for record in records)
            # no time or name in the gzip header: the same answers ship as the same bytes, not a new blob in git
            (into / f"{name}.gz").write_bytes(gzip.compress(text.encode(), compresslevel=9, mtime=0))
            shipped[name] = len(records)
        else:
            (into / f"{name}.gz").unlink(missing_ok=True)
    if (run / MANIFEST_FILE).is_file():
        shutil.copyfile(run / MANIFEST_FILE, into / MANIFEST_FILE)
    else:
        (into / MANIFEST_FILE).unlink(missing_ok=True)
    (into / SHIPPED_FILE).write_text(json.dumps({"recipe": asdict(recipe), "target": target, "records": shipped}))
    return shipped


def start_from(shipped: Path, recipe: CorpusRecipe, target: str, run: Path) -> bool:
    """The shipped corpus's files in ``run`` where it has none of its own, if it answers this recipe on this
    target (else nothing is copied); whether it did."""
    meta = shipped / SHIPPED_FILE
    if not meta.is_file():
        return False
    made = json.loads(meta.read_text())
    if made["recipe"] != asdict(recipe) or made["target"] != target:
        return False
    run.mkdir(parents=True, exist_ok=True)
    for name in STAGE_FILES:
        if (shipped / f"{name}.gz").is_file() and not (run / name).exists():
            with gzip.open(shipped / f"{name}.gz", "rt") as source, (run / name).open("w") as out:
                shutil.copyfileobj(source, out)
    if (shipped / MANIFEST_FILE).is_file() and not (run / MANIFEST_FILE).exists():
        shutil.copyfile(shipped / MANIFEST_FILE, run / MANIFEST_FILE)
    return True

"""The drafters' corpus: self-synthesis is seeded and follows the chat template, evaluation prompts never get in,
and the manifest counts what the recipe made, dropped and answered."""

from __future__ import annotations

import json

import pytest

from backends import AutoregressiveBackend
from backends.corpus.evaluation import AGENT_MIX, EvaluationFilter, evaluation_texts
from backends.corpus.recipe import MANIFEST_FILE, CorpusRecipe, Manifest, PromptFilter, TrainingPrompt, given_prompts
from backends.corpus.synthesis import Conversation, first_turn_requests, follow_up_requests, turn_prefix, user_turn
from backends.engine import BatchLimits
from backends.training.bulk import bulk_answers
from backends.training.dataset import (
    DISTILL_FILE,
    FOLLOW_UPS_FILE,
    SYNTHESIS_FILE,
    build_corpus,
    read_corpus,
    ship_corpus,
    start_from,
)
from backends.training.distill import engine_answers, read_distilled
from backends.types import GenerationRequest

RECIPE = CorpusRecipe(subtasks=10, stdlib=6, synthesised=14, follow_ups=4, max_tokens=16, sampled_share=0.5)


def _user(text: str) -> TrainingPrompt:
    return TrainingPrompt("synth:general", GenerationRequest(messages=[{"role": "user", "content": text}]))


def test_a_turn_prefix_is_the_template_up_to_the_users_words(tiny_tokenizer):
    history = [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "Seven."}]
    prefix = turn_prefix(tiny_tokenizer, history)
    whole = tiny_tokenizer.apply_chat_template([*history, {"role": "user", "content": "And another?"}], tokenize=False)
    assert whole.startswith(prefix) and whole[len(prefix) :].startswith("And another?")


def test_synthesis_requests_are_seeded(tiny_tokenizer):
    first = first_turn_requests(tiny_tokenizer, 20, seed=3)
    assert first == first_turn_requests(tiny_tokenizer, 20, seed=3)
    assert [r.seed for _, r in first] != [r.seed for _, r in first_turn_requests(tiny_tokenizer, 20, seed=4)]
    assert len({d for d, _ in first}) > 3 and all(r.temperature == 1.0 and r.prompt for _, r in first)
    history = [
        Conversation("code", [{"role": "user", "content": "Sort a list."}, {"role": "assistant", "content": "x"}])
    ]
    assert follow_up_requests(tiny_tokenizer, history, 3) == follow_up_requests(tiny_tokenizer, history, 3)


def test_a_synthesised_turn_must_read_as_a_request():
    assert user_turn("  Write a haiku about autumn leaves.\n") == "Write a haiku about autumn leaves."
    assert user_turn("ok") is None
    assert user_turn("Explain this <|im_start|>assistant sure") is None


def test_given_prompts_are_seeded_and_span_their_sources():
    prompts = given_prompts(RECIPE)
    assert [p.request for p in prompts] == [p.request for p in given_prompts(RECIPE)]
    assert {p.source.split(":")[0] for p in prompts} == {"subtask", "stdlib"} and len(prompts) == 16
    other = given_prompts(CorpusRecipe(subtasks=10, stdlib=6, seed=1))
    assert [p.request for p in prompts] != [p.request for p in other]


def test_the_filter_drops_an_evaluation_prompt_and_its_paraphrase_but_not_new_text():
    """Fed an evaluation prompt (the agent mix is in the repository; the shared benchmarks are read when beside
    it), the filter drops it, and a synthesised turn that quotes 13 of its words in a row."""
    texts = evaluation_texts()
    assert len(texts) >= 160 and AGENT_MIX.is_file()
    long = next(t for t in texts if len(t.split()) > 30)
    quote = " ".join(long.split()[5:20])
    manifest = Manifest(RECIPE)
    keep = PromptFilter(EvaluationFilter(texts), manifest)
    fresh = "Write a limerick about a lighthouse keeper who collects teapots."
    kept = keep([_user(long), _user(f"Please help: {quote} thanks"), _user(fresh), _user(fresh.upper())])
    assert [p.request.messages[0].content for p in kept] == [fresh]
    count = manifest.sources["synth"]
    assert (count.made, count.evaluation_overlap, count.duplicates, count.kept) == (4, 2, 1, 1)


def test_a_short_evaluation_prompt_is_matched_whole_not_by_its_words():
    keep = EvaluationFilter(["Hello", "Prove the Pythagorean theorem in two ways"])
    assert keep.leaks("hello!") and not keep.leaks("Hello, can you sort this list for me?")
    assert keep.leaks("Could you prove the Pythagorean theorem in two ways, please?")


@pytest.fixture(scope="module")
def corpus(tiny_model_paths, tmp_path_factory):
    backend = AutoregressiveBackend.from_pretrained(tiny_model_paths["llama"], limits=BatchLimits(max_batch=8))
    given = given_prompts(RECIPE)
    leaked = given[3].request.messages[-1].content  # an "evaluation prompt" the filter is fed
    evaluation = EvaluationFilter([leaked])
    run = tmp_path_factory.mktemp("corpus")
    answers, tokenizer = engine_answers(backend, 8), backend.loaded.tokenizer
    records, manifest = build_corpus(answers, tokenizer, RECIPE, run, evaluation=evaluation)
    again, _ = build_corpus(answers, tokenizer, RECIPE, run, evaluation=evaluation)  # resumed: nothing to redo
    return run, records, manifest, again, leaked, backend.loaded.tokenizer


def test_the_corpus_keeps_what_the_filter_lets_through(corpus):
    run, records, manifest, again, leaked, tokenizer = corpus
    assert [r.completion for r in again] == [r.completion for r in records]
    answered = read_distilled(run / DISTILL_FILE)
    assert len(answered) + len(read_distilled(run / FOLLOW_UPS_FILE)) == len(records)
    assert not any(leaked in tokenizer.decode(r.prompt) for r in records)
    assert manifest.sources["subtask"].evaluation_overlap + manifest.sources["stdlib"].evaluation_overlap == 1
    assert len(read_distilled(run / SYNTHESIS_FILE)) == RECIPE.synthesised


def test_the_manifest_counts_match_the_corpus(corpus):
    run, records, manifest, _, _, _ = corpus
    saved = json.loads((run / MANIFEST_FILE).read_text())
    by_family: dict[str, list] = {}
    for record in records:
        by_family.setdefault(record.source.split(":")[0], []).append(record)
    assert saved["sequences"] == len(records)
    assert saved["answer_tokens"] == sum(len(r.completion) for r in records) == manifest.answer_tokens
    for family, count in saved["sources"].items():
        assert count["answered"] == len(by_family.get(family, [])) and count["answered"] <= count["kept"]
        assert count["made"] == count["kept"] + count["evaluation_overlap"] + count["duplicates"]
        assert count["answer_tokens"] == sum(len(r.completion) for r in by_family.get(family, []))
    usable = saved["sources"].get("synth", {"made": 0})["made"]
    assert usable + sum(v for k, v in saved["unusable_synthesised_turns"].items() if k.startswith("synth:")) == 14
    assert saved["recipe"]["synthesised"] == RECIPE.synthesised


def test_a_run_starts_from_shipped_answers_of_its_own_recipe_and_target(corpus, tmp_path):
    """Answers shipped part-way (the follow-ups not yet answered) seed a run of the same recipe and target, which
    answers only the rest and ends with the corpus answered in one go; another recipe or target starts afresh.
    Shipped over a finished corpus's files, they leave none of its later stages or its manifest behind."""
    run, records, _, _, leaked, tokenizer = corpus
    partial = tmp_path / "partial"
    partial.mkdir()
    for name in (SYNTHESIS_FILE, DISTILL_FILE, "follow_up_synthesis.jsonl"):
        (partial / name).write_text((run / name).read_text())
    shipped = tmp_path / "shipped"
    ship_corpus(run, RECIPE, "target", shipped)
    assert ship_corpus(partial, RECIPE, "target", shipped)[DISTILL_FILE] == len(read_distilled(run / DISTILL_FILE))
    assert not (shipped / MANIFEST_FILE).exists() and not (shipped / f"{FOLLOW_UPS_FILE}.gz").exists()
    first_turns = (shipped / f"{DISTILL_FILE}.gz").read_bytes()

    other = CorpusRecipe(**{**RECIPE.__dict__, "seed": 1})
    assert not start_from(shipped, other, "target", tmp_path / "other")
    assert not start_from(shipped, RECIPE, "another target", tmp_path / "other")
    assert not (tmp_path / "other").exists()

    asked: list[tuple[int, list[int]]] = []
    follow_ups = {r.index: r for r in read_distilled(run / FOLLOW_UPS_FILE)}

    def answers(prompts, todo):
        if todo:
            asked.append((len(prompts), todo))
        return (follow_ups.get(i) for i in todo)  # None: a prompt the engine refused

    fresh = tmp_path / "fresh"
    assert start_from(shipped, RECIPE, "target", fresh)
    evaluation = EvaluationFilter([leaked])
    again, _ = build_corpus(answers, tokenizer, RECIPE, fresh, evaluation=evaluation)
    assert [todo for _, todo in asked] == [list(range(asked[0][0]))] and follow_ups
    assert [r.__dict__ for r in again] == [r.__dict__ for r in records]
    ship_corpus(fresh, RECIPE, "target", shipped)
    assert (shipped / f"{DISTILL_FILE}.gz").read_bytes() == first_turns  # the same answers, the same bytes
    finished = tmp_path / "finished"
    assert start_from(shipped, RECIPE, "target", finished)
    assert [r.__dict__ for r in read_corpus(finished)] == [r.__dict__ for r in records]


def test_bulk_answers_are_the_engines_for_greedy_prompts(tiny_model_paths):
    """The GPU path (one generate call over many left-padded prompts) gives the engine's greedy answers, stops at
    a chat-template marker, and leaves a prompt under a grammar to the engine."""
    backend = AutoregressiveBackend.from_pretrained(tiny_model_paths["llama"], limits=BatchLimits(max_batch=8))
    prompts = given_prompts(RECIPE)
    for text in ("Write a limerick about a lighthouse.", "List three prime numbers, please."):
        request = GenerationRequest(prompt=text, max_tokens=40, temperature=0, stop=["<|im_start|>"])
        prompts.append(TrainingPrompt("synth:general", request))
    todo = list(range(len(prompts)))
    engine = {r.index: r for r in engine_answers(backend, 8)(prompts, todo)}
    bulk = {r.index: r for r in bulk_answers(backend, rows=5)(prompts, todo)}
    assert bulk.keys() == engine.keys() == set(todo)
    assert any(p.request.response_format or p.request.tools for p in prompts)
    for i in todo:
        assert bulk[i].prompt == engine[i].prompt and bulk[i].completion == engine[i].completion, i

"""The dspark-mini corpus: chat rendered exactly like the serving template, reproducible, three sources."""

from __future__ import annotations

import itertools
import json

import jsonschema

from backends.dspark.corpus import (
    CHUNK_CHARS,
    OPENING_CHARS,
    build_corpus,
    build_corpus_parts,
    chat_openings,
    corpus_manifest,
    iter_chat_prompts,
    render_chat,
)
from backends.dspark.drills import iter_copy_drills
from backends.modelfactory import END_OF_TEXT, IM_END, IM_START
from backends.prompting import prompt_messages
from classifiers.subtasks import KINDS


def test_render_chat_matches_the_tokenizer_chat_template(tiny_tokenizer) -> None:
    examples = list(iter_chat_prompts(60, seed=4))
    assert {len(e.messages) for e in examples} == {1, 2}  # with and without a system message
    for example in examples:
        expected = tiny_tokenizer.apply_chat_template(example.messages, add_generation_prompt=True, tokenize=False)
        assert example.prompt == expected
        assert render_chat(example.messages, example.reference) == f"{expected}{example.reference}{IM_END}\n"


def test_prompt_messages_spell_out_tools_and_schemas_in_the_system_message() -> None:
    examples = list(iter_chat_prompts(400, seed=1, kinds=["tool_call_arguments", "json_extraction"]))
    for example in examples:
        subtask = example.subtask
        if subtask.tools is None and subtask.response_format is None:
            assert example.messages == subtask.messages
            continue
        system = example.messages[0]
        assert system["role"] == "system"
        if subtask.messages[0]["role"] == "system":
            assert system["content"].startswith(subtask.messages[0]["content"])
        for tool in subtask.tools or ():
            assert f"- {tool['function']['name']}(" in system["content"]
        if (subtask.response_format or {}).get("type") == "json_schema":
            schema = subtask.response_format["json_schema"]["schema"]
            assert json.dumps(schema, separators=(",", ":")) in system["content"]
    plain = [{"role": "user", "content": "hi"}]
    assert prompt_messages(plain) == plain
    assert prompt_messages(plain, {"type": "json_object"})[0] == {
        "role": "system",
        "content": "Reply with a JSON object.",
    }
    assert plain == [{"role": "user", "content": "hi"}]


def test_build_corpus_is_reproducible() -> None:
    first = build_corpus(40, seed=1, code_chunks=6, prose_chunks=6)
    assert first == build_corpus(40, seed=1, code_chunks=6, prose_chunks=6)
    assert first != build_corpus(40, seed=2, code_chunks=6, prose_chunks=6)


def test_corpus_holds_all_four_sources_each_document_ended_once() -> None:
    parts = build_corpus_parts(40, seed=0, code_chunks=6, prose_chunks=6)
    assert (len(parts.chat), len(parts.code), len(parts.prose)) == (40, 6, 6) and parts.drills
    docs = parts.documents()
    assert sorted(docs) == sorted([*parts.chat, *parts.drills, *parts.code, *parts.prose])
    assert all(doc.endswith(END_OF_TEXT) and doc.count(END_OF_TEXT) == 1 for doc in docs)
    chats = parts.chat + parts.drills
    assert all(doc.startswith(IM_START) and doc.endswith(f"{IM_END}\n{END_OF_TEXT}") for doc in chats)
    assert all(doc.startswith("# ") and IM_START not in doc for doc in parts.code)
    assert all(IM_START not in doc and "copyright" not in doc.lower() for doc in parts.code + parts.prose)
    used = parts.code_files + parts.prose_files
    assert used and not any(part in path.split("/") for path in used for part in ("test", "site-packages"))


def test_default_mix_sizes_drills_code_and_prose_from_the_chat_part() -> None:
    parts = build_corpus_parts(60, seed=0)
    chat, drills, code, prose = (sum(map(len, d)) for d in (parts.chat, parts.drills, parts.code, parts.prose))
    slack = CHUNK_CHARS + 100
    assert chat * 25 / 50 <= drills <= chat * 25 / 50 + slack
    assert chat * 15 / 50 <= code <= chat * 15 / 50 + slack
    assert chat * 10 / 50 <= prose <= chat * 10 / 50 + slack


def test_copy_drills_answer_with_values_found_only_in_their_prompt() -> None:
    """Every drill's answer is made of values its own prompt spells out, and the values are not a small
    list a model could learn: across 400 drills almost no value repeats."""
    drills = list(itertools.islice(iter_copy_drills(seed=3), 500))
    assert drills == list(itertools.islice(iter_copy_drills(seed=3), 500))
    values = []
    for messages, answer in drills:
        if messages[0]["content"].startswith("Reply with JSON"):
            continue  # schema drills, below
        prompt = messages[-1]["content"]
        parsed = json.loads(answer) if answer.startswith("{") else {"value": answer}
        found = parsed.get("arguments", parsed)
        assert all(str(value) in prompt for value in found.values()), (prompt, answer)
        values += [str(v) for v in found.values()]
    assert len(set(values)) > 0.9 * len(values)


def test_schema_drills_answer_with_short_instances_of_their_schema() -> None:
    """Schema drills teach closing an answer on schemas unlike the templates: each answer is an instance of
    the schema its note spells out (or, for a schema too long to spell out, uses only the keys it names)."""
    drills = itertools.islice(iter_copy_drills(seed=5), 2000)
    schema_drills = [(m[0]["content"], a) for m, a in drills if m[0]["content"].startswith("Reply with JSON")]
    assert len(schema_drills) == 400
    spelled = 0
    for note, answer in schema_drills:
        instance = json.loads(answer)
        if note.startswith("Reply with JSON matching this schema: "):
            jsonschema.validate(instance, json.loads(note.removeprefix("Reply with JSON matching this schema: ")))
            spelled += 1
        else:
            assert set(instance) <= set(note.removeprefix("Reply with JSON with the keys: ").split(", "))
        assert len(answer) < 600
    assert spelled > 0.8 * len(schema_drills)


def test_manifest_names_sources_and_licences() -> None:
    manifest = corpus_manifest(20, seed=0, code_chunks=3, prose_chunks=3)
    names = {source["name"]: source for source in manifest["sources"]}
    assert set(names) == {
        "synthetic-agent-subtasks",
        "copy-drills",
        "python-stdlib-source",
        "python-stdlib-docstrings",
    }
    assert names["python-stdlib-source"]["licence"].startswith("PSF")
    assert names["python-stdlib-source"]["python_version"]
    assert names["synthetic-agent-subtasks"]["kinds"] == list(KINDS)
    assert manifest["chars"] == sum(source["chars"] for source in manifest["sources"])
    assert manifest["documents"] == 26 + names["copy-drills"]["documents"]
    json.dumps(manifest)  # ready for the model card


def test_chat_openings_are_user_requests_about_unseen_code_and_prose() -> None:
    """Self-distillation prompts shaped like real requests: one user turn, no system message, each opening a
    different chunk of standard-library code or docstrings, reproducible from the seed."""
    prompts = chat_openings(30, seed=2)
    assert prompts == chat_openings(30, seed=2) and len(set(prompts)) == 30
    for prompt in prompts:
        assert prompt.startswith(f"{IM_START}user\n") and prompt.endswith(f"{IM_START}assistant\n")
        assert prompt.count(IM_START) == 2 and len(prompt) < OPENING_CHARS + 200
    assert sum("```python" in p or "code do?" in p for p in prompts) >= 10

"""The synthetic subtask generator: reproducible, well-formed, and honest about which kinds are deterministic."""

from __future__ import annotations

import json
from collections import Counter, defaultdict

import jsonschema
import pytest

from backends.corpus.subtasks import (
    KINDS,
    OPEN_ENDED_KINDS,
    Subtask,
    generate_subtasks,
    read_jsonl,
    split_by_template,
    templates_of,
    write_jsonl,
)
from backends.types import GenerationRequest

ALL_TEMPLATES = [template for kind in KINDS for template in templates_of(kind)]


@pytest.fixture(scope="module")
def sample() -> list[Subtask]:
    return generate_subtasks(3000, seed=7)


def _user_text(subtask: Subtask) -> str:
    return subtask.messages[-1]["content"]


def test_same_seed_same_subtasks_and_different_seed_different() -> None:
    assert generate_subtasks(200, seed=3) == generate_subtasks(200, seed=3)
    assert generate_subtasks(200, seed=3) != generate_subtasks(200, seed=4)


def test_every_kind_has_three_templates_and_small_samples_cover_every_kind(sample: list[Subtask]) -> None:
    assert all(len(templates_of(kind)) >= 3 for kind in KINDS)
    assert {s.kind for s in generate_subtasks(len(KINDS), seed=0)} == set(KINDS)
    assert {s.template for s in sample} == set(ALL_TEMPLATES)
    assert all(template.startswith(f"{kind}/") for kind in KINDS for template in templates_of(kind))


def test_fields_are_well_formed(sample: list[Subtask]) -> None:
    for s in sample:
        assert s.kind in KINDS
        assert s.template in templates_of(s.kind)
        roles = [m["role"] for m in s.messages]
        assert roles in (["user"], ["system", "user"]), roles
        assert all(m["content"] for m in s.messages)
        assert len(_user_text(s).split()) <= 60
        assert 0 < len(s.reference) <= 400
        assert s.max_tokens >= len(s.reference)  # no byte-level tokenizer can truncate the reference
        assert not any(stop in s.reference for stop in s.stop)
        assert (s.tools is not None) == (s.kind == "tool_call_arguments")
        GenerationRequest(**s.to_request_dict())  # the shared request type accepts every subtask


def test_json_references_validate_against_their_own_schema(sample: list[Subtask]) -> None:
    formats = Counter()
    for s in sample:
        kind = (s.response_format or {}).get("type")
        formats[kind] += 1
        if kind == "json_schema":
            jsonschema.validate(json.loads(s.reference), s.response_format["json_schema"]["schema"])
        elif kind == "json_object":
            assert isinstance(json.loads(s.reference), dict)
        if s.kind == "json_extraction":
            values = json.loads(s.reference).values()
            assert all(str(value) in _user_text(s) for value in values)  # extraction copies, it never invents
    assert formats["json_schema"] and formats["json_object"]


def test_tool_call_references_name_an_offered_tool_with_valid_arguments(sample: list[Subtask]) -> None:
    calls = [s for s in sample if s.kind == "tool_call_arguments"]
    assert calls
    for s in calls:
        call = json.loads(s.reference)
        offered = {tool["function"]["name"]: tool["function"] for tool in s.tools}
        assert set(call) == {"name", "arguments"}
        assert call["name"] in offered
        jsonschema.validate(call["arguments"], offered[call["name"]]["parameters"])
        assert all(str(value) in _user_text(s) for value in call["arguments"].values())


def test_qa_answers_come_from_the_context(sample: list[Subtask]) -> None:
    for s in sample:
        if s.kind == "qa_context":
            answer = s.reference.removeprefix("The ").rstrip(".").split(" is ", 1)[-1]
            assert answer in _user_text(s)


def test_sampling_parameters_vary_within_both_groups(sample: list[Subtask]) -> None:
    by_group = defaultdict(set)
    for s in sample:
        by_group[s.open_ended].add(s.temperature > 0)
        assert 0.0 <= s.temperature <= 1.0 and 0.0 < s.top_p <= 1.0
    assert by_group[True] == {True, False} and by_group[False] == {True, False}
    greedy = Counter(s.open_ended for s in sample if s.temperature == 0)
    assert greedy[False] > greedy[True]


def test_open_ended_answers_are_unpredictable_and_deterministic_ones_are_not(sample: list[Subtask]) -> None:
    answers = defaultdict(set)
    for s in sample:
        answers[(s.kind, json.dumps(s.messages), json.dumps(s.response_format))].add(s.reference)
    # A fixed prompt ("Hi! How is your day going?") gets many different answers...
    assert max(len(refs) for (kind, *_), refs in answers.items() if kind in OPEN_ENDED_KINDS) > 5
    # ...while a repeated deterministic prompt always gets the same one.
    assert all(len(refs) == 1 for (kind, *_), refs in answers.items() if kind not in OPEN_ENDED_KINDS)


def test_kind_and_template_filters() -> None:
    assert {s.kind for s in generate_subtasks(30, seed=1, kinds=["open_chat", "code_edit"])} == {
        "open_chat",
        "code_edit",
    }
    chosen = templates_of("summarisation")[:2]
    assert {s.template for s in generate_subtasks(30, seed=1, templates=chosen)} == set(chosen)
    with pytest.raises(ValueError):  # the filters intersect, and here nothing is left
        generate_subtasks(5, kinds=["open_chat"], templates=chosen)
    with pytest.raises(ValueError):
        generate_subtasks(5, kinds=["poetry"])
    with pytest.raises(ValueError):
        generate_subtasks(5, templates=["poetry/sonnet_v1"])


def test_split_by_template_keeps_unseen_templates_out_of_training(sample: list[Subtask]) -> None:
    train, val, test = split_by_template(sample, seed=5)
    names = [{s.template for s in split} for split in (train, val, test)]
    assert not (names[0] & names[1] or names[0] & names[2] or names[1] & names[2])
    assert len(train) + len(val) + len(test) == len(sample)
    for split in (train, val, test):
        assert {s.kind for s in split} == set(KINDS)
    assert split_by_template(sample, seed=5) == (train, val, test)
    assert split_by_template(sample, seed=6) != (train, val, test)


def test_split_keeps_kinds_with_few_templates_in_training() -> None:
    few = generate_subtasks(40, seed=2, templates=templates_of("open_chat")[:2])
    train, val, test = split_by_template(few)
    assert len(train) == 40 and not val and not test


def test_to_request_dict_omits_none_and_copies() -> None:
    plain = next(s for s in generate_subtasks(50, seed=0, kinds=["open_chat"]) if not s.stop)
    assert set(plain.to_request_dict()) == {"messages", "temperature", "top_p", "max_tokens"}
    call = generate_subtasks(1, seed=0, kinds=["tool_call_arguments"])[0]
    request = call.to_request_dict()
    assert {"messages", "tools", "temperature", "top_p", "max_tokens"} <= set(request)
    request["messages"][0]["content"] = "changed"
    request["tools"].clear()
    assert call.messages[0]["content"] != "changed" and call.tools


def test_jsonl_round_trip(tmp_path, sample: list[Subtask]) -> None:
    path = write_jsonl(sample[:300], tmp_path / "subtasks.jsonl")
    assert read_jsonl(path) == sample[:300]

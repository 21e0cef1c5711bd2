"""``bench quality``: its scorers give references full marks and broken answers none, and it runs end to end."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from backends.corpus.subtasks import KINDS, OPEN_ENDED_KINDS, generate_subtasks
from backends.types import GenerationResult, GenerationStats, Usage
from benchmarks import quality

SUBTASKS = generate_subtasks(4 * len(KINDS), seed=quality.HELD_OUT_SEED)


def answered(text: str, finish_reason: str = "eos", tool_calls: list | None = None) -> GenerationResult:
    return GenerationResult(
        text=text,
        token_ids=[],
        finish_reason=finish_reason,
        usage=Usage(prompt_tokens=1, completion_tokens=1),
        stats=GenerationStats(),
        tool_calls=tool_calls,
    )


def reference_call(reference: str) -> list[dict]:
    call = json.loads(reference)
    return [{"type": "function", "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}]


def scores_for(answer) -> dict[str, quality.KindScore]:
    scores = {kind: quality.KindScore() for kind in KINDS}
    for subtask in SUBTASKS:
        scores[subtask.kind].add(subtask, answer(subtask))
    return scores


def test_references_score_full_marks():
    def perfect(subtask):
        calls = reference_call(subtask.reference) if subtask.kind == "tool_call_arguments" else None
        return answered(subtask.reference, tool_calls=calls)

    overall = quality.summarise(scores_for(perfect))
    assert overall == {
        "exact_overall": 1.0,
        "exact_every_kind": 1.0,
        "json_fields": 1.0,
        "code_parses": 1.0,
        "tool_args": 1.0,
    }


def test_wrong_answers_score_nothing():
    overall = quality.summarise(scores_for(lambda subtask: answered("def (:", finish_reason="length")))
    assert overall == {
        "exact_overall": 0.0,
        "exact_every_kind": 0.0,
        "json_fields": 0.0,
        "code_parses": 0.0,
        "tool_args": 0.0,
    }


def test_json_fields_and_tool_calls_count_what_is_right():
    reference = '{"name": "Bruno Kowalski", "date": "2026-07-23", "city": "Dublin"}'
    assert quality.json_fields(reference, '{"name": "Tara Larsen", "date": "2026-07-23", "city": "Dublin"}') == (2, 3)
    assert quality.json_fields(reference, "not json") == (0, 3)
    tool = next(s for s in SUBTASKS if s.kind == "tool_call_arguments")
    call = reference_call(tool.reference)
    wrong = json.loads(call[0]["function"]["arguments"])
    wrong[next(iter(wrong))] = "something else"
    assert quality.tool_call_right(tool, call)
    assert not quality.tool_call_right(tool, [{"function": {**call[0]["function"], "arguments": json.dumps(wrong)}}])
    assert not quality.tool_call_right(tool, None)


def test_distinct_n_sees_repetition():
    assert quality.distinct_n(["a b c d"], 2) == 1.0
    assert quality.distinct_n(["a b a b a b"], 2) == pytest.approx(2 / 5)


def test_runs_end_to_end_on_a_tiny_model(tiny_model_paths, tmp_path, capsys):
    out = tmp_path / "quality.json"
    args = SimpleNamespace(model=tiny_model_paths["llama"], per_kind=1, max_tokens=8, seed=7, json=out)
    assert quality.run(args) == 0
    report = json.loads(out.read_text())
    assert set(report["modes"]) == {"greedy", "t0.7"}
    greedy = report["modes"]["greedy"]["kinds"]
    assert all(greedy[kind]["count"] == 1 for kind in KINDS)
    assert all("distinct_2" in greedy[kind] for kind in OPEN_ENDED_KINDS)
    assert report["targets"]["met_greedy"]["exact_overall"] is False  # a random model answers nothing right
    assert "code_completion" in capsys.readouterr().out

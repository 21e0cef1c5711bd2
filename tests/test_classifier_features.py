"""Request features: every request shape the gateway accepts, HashingVectorizer's exact text columns."""

from __future__ import annotations

import math

import numpy as np
import pytest
from sklearn.feature_extraction.text import HashingVectorizer

from backends.corpus.subtasks import generate_subtasks
from classifiers.features import RequestVectorizer
from classifiers.request_rows import (
    STRUCTURE_FEATURES,
    TEXT_HEAD_CHARS,
    TEXT_TAIL_CHARS,
    TEXT_WEIGHT,
    request_text,
    structure,
    word_grams,
)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "date": {"type": "string"}}},
    },
}
SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "person",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "address": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}},
            },
        },
    },
}
REQUEST_SHAPES = {
    "empty": {},
    "no_messages": {"messages": []},
    "user_only": {"messages": [{"role": "user", "content": "Say hi."}]},
    "content_none": {"messages": [{"role": "system", "content": None}, {"role": "user", "content": None}]},
    "content_parts": {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Extract the city."}, {"type": "image_url"}]}
        ]
    },
    "tool_history": {
        "messages": [
            {"role": "developer", "content": "You call tools."},
            {"role": "user", "content": "Weather in Oslo tomorrow?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 3}'},
        ],
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    },
    "json_schema": {
        "messages": [{"role": "user", "content": "Ann lives in Paris."}],
        "response_format": SCHEMA_FORMAT,
        "temperature": 0,
        "max_tokens": 64,
        "stop": "\n",
    },
    "json_object": {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
    "regex": {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "regex", "regex": r"\d+"}},
    "json_schema_without_schema": {
        "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema"},
    },
    "prompt_only": {"prompt": "def add(a, b):", "max_completion_tokens": 16, "stop": ["\ndef "]},
    "wrong_types": {
        "messages": ["not a message", {"role": "user", "content": 42}, {"content": "no role"}],
        "tools": "not a list",
        "response_format": "json",
        "temperature": "hot",
        "top_p": None,
        "max_tokens": None,
        "stop": [None, 3, "END"],
        "tool_choice": "required",
    },
    "nulls": {"messages": None, "tools": None, "response_format": None, "stop": None, "temperature": None},
}


@pytest.mark.parametrize("name", list(REQUEST_SHAPES))
def test_every_request_shape_gives_a_finite_row(name):
    vectorizer = RequestVectorizer()
    indices, values = vectorizer.row(REQUEST_SHAPES[name])
    assert len(indices) == len(values) >= len(STRUCTURE_FEATURES)
    assert indices.min() >= 0 and indices.max() < vectorizer.n_features
    assert np.isfinite(values).all()
    assert vectorizer.transform([REQUEST_SHAPES[name]]).shape == (1, vectorizer.n_features)


def test_a_non_dict_request_is_an_empty_one():
    vectorizer = RequestVectorizer()
    for got, want in zip(vectorizer.row(None), vectorizer.row({})):
        assert np.array_equal(got, want)


def test_structure_reads_formats_tools_and_sampling():
    schema = structure(REQUEST_SHAPES["json_schema"])
    assert schema["format_json_schema"] == 1.0 and schema["format_none"] == 0.0
    assert schema["schema_properties"] == pytest.approx(math.log1p(3) / 7)
    assert schema["schema_enums"] > 0 and schema["schema_strict"] == 1.0
    assert schema["greedy"] == 1.0 and schema["stops"] == 0.25 and schema["newline_stop"] == 1.0
    tools = structure(REQUEST_SHAPES["tool_history"])
    assert tools["tools"] > 0 and tools["tool_parameters"] == pytest.approx(math.log1p(2) / 7)
    assert tools["tool_history"] == 1.0 and tools["tool_choice_forced"] == 1.0 and tools["has_system"] == 1.0
    # OpenAI's defaults when fields are left out: temperature 1, top_p 1, no format.
    empty = structure({})
    assert empty["greedy"] == 0.0 and empty["temperature"] == 0.5 and empty["top_p"] == 1.0
    assert empty["format_none"] == 1.0


def test_text_is_system_and_last_user_message_bounded_in_length():
    assert request_text(REQUEST_SHAPES["tool_history"]) == "You call tools.\nWeather in Oslo tomorrow?"
    assert request_text(REQUEST_SHAPES["content_parts"]) == "Extract the city."
    long = {"messages": [{"role": "user", "content": "word " * 10_000}]}
    assert len(request_text(long)) == TEXT_HEAD_CHARS + TEXT_TAIL_CHARS + 1


def test_text_columns_are_a_hashing_vectorizer_at_the_text_weight():
    requests = [subtask.to_request_dict() for subtask in generate_subtasks(60, seed=5)]
    vectorizer = RequestVectorizer()
    rows = vectorizer.transform(requests)
    texts = [request_text(request) for request in requests]
    words = HashingVectorizer(n_features=vectorizer.word_features, ngram_range=(1, 2), alternate_sign=False)
    expected = words.transform(texts) * TEXT_WEIGHT
    assert abs(rows[:, : vectorizer.word_features] - expected).max() < 1e-12
    structure_block = rows[:, vectorizer.word_features :].toarray()
    assert structure_block.shape[1] == len(STRUCTURE_FEATURES)
    assert structure_block.min() >= 0.0 and structure_block.max() <= 1.0
    untexted = RequestVectorizer(text_weight=0.0).transform(requests)
    assert untexted[:, : vectorizer.word_features].nnz == 0
    assert abs(untexted - rows)[:, vectorizer.word_features :].max() == 0


def test_what_a_request_says_about_its_answer():
    """Cues any wording may carry: a label or value answer is a few tokens; an edit of given text copies it."""

    def cues(text: str) -> dict[str, float]:
        return structure({"messages": [{"role": "user", "content": text}]})

    ticket = "Ticket: my card was charged twice on the second of May"
    asked = f"Which team should handle this? Options: billing, tech.\n\n{ticket}"
    label = cues(asked)
    assert label["short_answer"] == 1.0 and label["reshape"] == 0.0
    assert label["source_share"] == pytest.approx(len(ticket) / len(asked))
    edit = cues("Fix the spelling in this note.\nthe meeting is on tuesday at teh office")
    assert edit["reshape"] == 1.0 and edit["short_answer"] == 0.0 and edit["source_share"] > 0.5
    story = cues("Write a story about a lighthouse keeper.")
    assert story["reshape"] == story["short_answer"] == story["source_share"] == 0.0
    assert cues("Summarise in one sentence: the launch moved.")["brief_answer"] == 1.0
    loops = "for item in items:\n    print(item)\nfor item in items:\n    save(item)"
    assert cues(loops)["repeated_trigrams"] == pytest.approx(2 / 10) and story["repeated_trigrams"] == 0.0


@pytest.mark.parametrize("ngrams", [(1, 1), (1, 2), (2, 3)])
def test_the_word_grams_are_hashing_vectorizers_own(ngrams):
    """The analyser the router runs without scikit-learn, against scikit-learn's, on text with accents, digits,
    underscores, one-letter words and punctuation; and the hash behind the columns."""
    from sklearn.utils import murmurhash3_32

    from classifiers.request_rows import _column

    texts = [
        "Élodie's ünïcode café: naïve façade, 12 a_b x y zz!",
        "def parse(line):\n    return line.split(',')  # CSV",
        "",
        "a",
        "JSON JSON json Json — émigré straße",
        *(request_text(s.to_request_dict()) for s in generate_subtasks(22, seed=5)),
    ]
    analyser = HashingVectorizer(analyzer="word", ngram_range=ngrams).build_analyzer()
    for text in texts:
        assert word_grams(text, ngrams) == analyser(text)
        for gram in word_grams(text, ngrams):
            h = murmurhash3_32(gram, seed=0)
            assert _column(gram, 2**15) == abs(h) % 2**15

"""Both backends under one grammar engine: outputs stay valid, DSpark spans are cut, refusals come first."""

from __future__ import annotations

import json
import re
from collections import Counter

import jsonschema
import pytest
from scipy.stats import chi2_contingency

from backends import AutoregressiveBackend, GenerationRequest, UnsupportedFormatError
from backends.dspark.backend import DSparkBackend
from backends.dspark.selection import SpanPolicy
from tests.test_dspark import perturbed_heads_model
from tests.test_dspark_drafter import perturbed_drafter

REGEX = r"[a-z]{2,4}-[0-9]{2}( [A-Z][a-z]{1,3}){1,2}"
SCHEMA = {
    "type": "object",
    "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}, "n": {"type": "integer", "enum": [1, 2, 3]}},
    "required": ["code", "n"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "set_alarm",
            "parameters": {
                "type": "object",
                "properties": {"hour": {"type": "integer", "enum": [6, 7, 8]}},
                "required": ["hour"],
                "additionalProperties": False,
            },
        },
    },
]


@pytest.fixture(scope="module")
def backends(tiny_model_paths):
    model = perturbed_heads_model(tiny_model_paths["llama"], seed=5)
    return {
        "ar": AutoregressiveBackend(model.loaded),
        "dspark": DSparkBackend(model, SpanPolicy((1, 2, 4), {2: 0.0, 4: 0.0})),
        "dspark-confidence": DSparkBackend(model, SpanPolicy((1, 2, 4), {2: 0.0, 4: 0.0}, "confidence")),
        "dspark-drafter": DSparkBackend(
            None, drafter=perturbed_drafter(model.loaded, seed=5), default="dspark", loaded=model.loaded
        ),
    }


def _request(**fields) -> GenerationRequest:
    messages = [{"role": "user", "content": "answer"}]
    return GenerationRequest(**{"messages": messages, "max_tokens": 96, "temperature": 0.0, **fields})


@pytest.mark.parametrize("name", ["ar", "dspark", "dspark-confidence", "dspark-drafter"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_output_matches(backends, name, temperature):
    for seed in range(3):
        request = _request(response_format={"type": "regex", "regex": REGEX}, temperature=temperature, seed=seed)
        result = backends[name].complete(request)
        assert result.finish_reason in {"stop", "eos"}, result
        assert re.fullmatch(REGEX, result.text)


@pytest.mark.parametrize("name", ["ar", "dspark", "dspark-confidence", "dspark-drafter"])
def test_json_schema_output_validates_and_counts_forced_tokens(backends, name):
    schema_format = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": True}}
    for seed in range(3):
        result = backends[name].complete(_request(response_format=schema_format, temperature=1.0, seed=seed))
        assert result.finish_reason in {"stop", "eos"}
        jsonschema.validate(json.loads(result.text), SCHEMA)
        assert result.stats.forced_tokens > 0
        assert backends[name].loaded.tokenizer.decode(result.token_ids) == result.text


def test_greedy_dspark_under_a_grammar_equals_greedy_ar(backends):
    for response_format in [
        {"type": "regex", "regex": REGEX},
        {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}},
    ]:
        request = _request(response_format=response_format)
        for name in ("dspark", "dspark-drafter"):
            assert backends[name].complete(request).token_ids == backends["ar"].complete(request).token_ids


@pytest.mark.parametrize("name", ["dspark", "dspark-drafter"])
def test_sampled_dspark_under_a_grammar_keeps_plain_samplings_distribution(backends, name):
    """Every round here meets the grammar: the drafts' free tokens are refused (drawn again from max(0, p - q)), and
    the forced text "-done-" rides in the drafts' place, kept unchecked as plain decoding keeps it. Sampled answers
    stay distributed as plain sampling's (a contingency test against plain decoding's, 400 seeds each)."""
    regex = r"(x|y)(x|y)?-done-(x|y)"
    counts: dict[str, Counter[str]] = {"ar": Counter(), name: Counter()}
    for seed in range(400):
        request = _request(response_format={"type": "regex", "regex": regex}, temperature=1.0, seed=seed)
        for backend, seen in counts.items():
            result = backends[backend].complete(request)
            assert re.fullmatch(regex, result.text)
            seen[result.text] += 1
    answers = sorted(set(counts["ar"]) | set(counts[name]))
    table = [[seen[answer] for answer in answers] for seen in counts.values()]
    assert len(answers) >= 6 and chi2_contingency(table).pvalue > 0.01


@pytest.mark.parametrize("name", ["ar", "dspark", "dspark-drafter"])
@pytest.mark.parametrize(
    ("tool_choice", "expected"),
    [
        ("required", {"get_weather", "set_alarm"}),
        ({"type": "function", "function": {"name": "set_alarm"}}, {"set_alarm"}),
    ],
)
def test_tool_calls_are_constrained_by_each_tools_schema(backends, name, tool_choice, expected):
    names = set()
    for seed in range(4):
        request = _request(tools=TOOLS, tool_choice=tool_choice, temperature=1.0, seed=seed)
        result = backends[name].complete(request)
        assert result.finish_reason == "tool_calls"
        (call,) = result.tool_calls
        tool = next(t["function"] for t in TOOLS if t["function"]["name"] == call["function"]["name"])
        jsonschema.validate(json.loads(call["function"]["arguments"]), tool["parameters"])
        names.add(call["function"]["name"])
    assert names <= expected


def test_tool_choice_none_leaves_output_free(backends):
    result = backends["ar"].complete(_request(tools=TOOLS, tool_choice="none", max_tokens=8))
    assert result.tool_calls is None
    assert result.finish_reason == "length"


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "foo"}}},
        {"type": "yaml"},
        {"type": "json_schema"},
        {"type": "grammar", "grammar": "start: ((("},
    ],
)
def test_uncompilable_formats_are_refused_before_decoding(backends, response_format):
    for backend in backends.values():
        with pytest.raises(UnsupportedFormatError) as err:
            backend.complete(_request(response_format=response_format))
        assert err.value.param == "response_format"
        assert err.value.status_code == 400


def test_stream_under_a_grammar_joins_to_the_valid_result(backends):
    request = _request(response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}})
    chunks = list(backends["dspark"].stream(request))
    text = "".join(c.delta for c in chunks)
    assert text == chunks[-1].result.text
    jsonschema.validate(json.loads(text), SCHEMA)

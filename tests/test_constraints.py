"""The grammar constraint engine: JSON schemas from JSONSchemaBench, regexes, Lark, tool calls, span checks.

Schema outputs are produced by a seeded random walk over the grammar's masks (forced tokens taken as they
come, a bias toward tokens that close what is open so the walk ends), then parsed and validated with
``jsonschema``. A sample of the 480 schemas runs by default; ``DSPARK_FULL_SCHEMAS=1`` runs them all.
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from backends.constraints import (
    ConstraintError,
    GrammarConstraint,
    cut_tool_call,
    parse_tool_calls,
    request_grammar,
)
from backends.constraints.vocabulary import llg_tokenizer
from backends.dspark.published_decode import Proposal, obeying
from backends.errors import UnsupportedFormatError
from backends.loading import load_model
from backends.modelfactory import END_OF_TEXT, IM_END
from backends.types import GenerationRequest

SCHEMA_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "jsonschemabench"
FULL_SCHEMAS = os.environ.get("DSPARK_FULL_SCHEMAS") == "1"
SAMPLE_SIZE = 120
VOCAB = 520  # logits padded past the tokenizer's 512 ids, as real checkpoints often are
WALK_LIMIT = 400
CLOSE_BIAS = 0.7

POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
    "required": ["x", "y"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "$defs": {"small": {"type": "integer", "minimum": 0, "maximum": 99}},
                "properties": {"a": {"$ref": "#/$defs/small"}, "b": {"$ref": "#/$defs/small"}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "now"}},
]


def _request(**fields) -> GenerationRequest:
    return GenerationRequest(**{"prompt": "Answer:", "temperature": 0.0, **fields})


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def eos_ids(tiny_tokenizer) -> frozenset[int]:
    return frozenset(tiny_tokenizer.convert_tokens_to_ids([IM_END, END_OF_TEXT]))


@pytest.fixture(scope="module")
def constrain(tiny_tokenizer, eos_ids):
    def build(**fields) -> GrammarConstraint | None:
        return GrammarConstraint.from_request(_request(**fields), tiny_tokenizer, VOCAB, eos_ids)

    return build


@pytest.fixture(scope="module")
def walker(tiny_tokenizer, eos_ids):
    """Seeded random walks over a constraint's masks; returns the text, or None if it did not finish."""
    pieces = [tiny_tokenizer.decode([i]) for i in range(len(tiny_tokenizer))]
    # Preferred in this order when the bias fires: end the output, close a string, close a container.
    tiers = [
        eos_ids,
        {i for i, p in enumerate(pieces) if p == '"'},
        {i for i, p in enumerate(pieces) if p and set(p) <= set('"}]')},
    ]

    def walk(constraint: GrammarConstraint, seed: object, limit: int = WALK_LIMIT) -> str | None:
        rng = random.Random(str(seed))
        tokens: list[int] = []
        while len(tokens) < limit and not constraint.is_finished:
            step = constraint.forced_tokens()
            if not step:
                allowed = constraint.allowed_tokens().nonzero().flatten().tolist()
                assert allowed, f"empty mask after {tiny_tokenizer.decode(tokens)!r}"
                closing = next((c for c in ([t for t in allowed if t in tier] for tier in tiers) if c), [])
                step = [rng.choice(closing if closing and rng.random() < CLOSE_BIAS else allowed)]
            constraint.consume(step)
            tokens += step
        finished = constraint.is_finished
        constraint.rollback(len(tokens))
        return tiny_tokenizer.decode([t for t in tokens if t not in eos_ids]) if finished else None

    return walk


@pytest.fixture(scope="module")
def bench(constrain) -> list[tuple[str, dict, GrammarConstraint | None]]:
    """(name, entry, constraint or None where refused) for the sampled JSONSchemaBench schemas."""
    if not SCHEMA_DIR.is_dir():
        pytest.skip(f"JSONSchemaBench sample not found at {SCHEMA_DIR}")
    files = sorted(SCHEMA_DIR.glob("*.json"))
    if not FULL_SCHEMAS:
        files = sorted(random.Random(0).sample(files, SAMPLE_SIZE))
    compiled = []
    for path in files:
        entry = json.loads(path.read_text())
        try:
            constraint = constrain(response_format=_schema_format(entry["schema"]))
        except UnsupportedFormatError as exc:
            assert exc.param == "response_format" and exc.message
            constraint = None
        compiled.append((path.stem, entry, constraint))
    rate = sum(c is not None for *_, c in compiled) / len(compiled)
    print(f"\nJSONSchemaBench: {rate:.1%} of {len(compiled)} schemas compile; the rest are refused")
    return compiled


def test_bench_outputs_validate_against_their_schemas(bench, walker):
    finished = 0
    compiled = [(name, entry, c) for name, entry, c in bench if c is not None]
    for name, entry, constraint in compiled:
        text = walker(constraint, name)
        if text is None:
            continue
        finished += 1
        jsonschema.validate(json.loads(text), entry["schema"])
    print(f"\nrandom walks finished for {finished} of {len(compiled)} compiled schemas; every one validated")
    assert len(compiled) >= 0.7 * len(bench)
    assert finished >= 0.9 * len(compiled)


def test_bench_instances_agree_with_the_grammar(bench, tiny_tokenizer, eos_ids):
    """Known-valid instances are accepted to the end (then EOS), known-invalid ones rejected somewhere."""
    eos = min(eos_ids)
    agree = {True: [0, 0], False: [0, 0]}
    for _, entry, constraint in bench:
        if constraint is None:
            continue
        for case in entry["tests"]:
            tokens = [*tiny_tokenizer.encode(json.dumps(case["data"], ensure_ascii=False)), eos]
            accepted = constraint.valid_prefix(tokens) == len(tokens)
            agree[case["valid"]][0] += accepted == case["valid"]
            agree[case["valid"]][1] += 1
    (valid_ok, valid_n), (invalid_ok, invalid_n) = agree[True], agree[False]
    print(f"\nvalid instances accepted {valid_ok}/{valid_n}, invalid instances rejected {invalid_ok}/{invalid_n}")
    assert valid_ok >= 0.9 * valid_n
    assert invalid_ok >= 0.9 * invalid_n


@pytest.mark.parametrize(
    ("response_format", "needle"),
    [
        (_schema_format({"type": "foo"}), "foo"),
        (_schema_format({"type": "string", "not": {"pattern": "^a"}}), "not"),
        (_schema_format({"oneOf": [{"type": "integer"}, {"minimum": 0}]}), "oneOf"),
        (_schema_format({"type": "string", "pattern": "(("}), "regex"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": "object"}}, "schema"),
        ({"type": "json_schema"}, "json_schema"),
        ({"type": "xml"}, "xml"),
        ({"schema": {}}, "None"),
        ({"type": "regex"}, "regex"),
        ({"type": "regex", "regex": "(?=lookahead)"}, "look-around"),
        ({"type": "grammar", "grammar": ""}, "grammar"),
        ({"type": "grammar", "grammar": "start: undefined_rule"}, "undefined_rule"),
    ],
)
def test_refused_before_decoding(constrain, response_format, needle):
    with pytest.raises(UnsupportedFormatError, match=re.escape(needle)) as caught:
        constrain(response_format=response_format)
    assert caught.value.param == "response_format"


@pytest.mark.parametrize(
    "fields",
    [{}, {"response_format": {"type": "text"}}, {"tools": TOOLS, "tool_choice": "none"}, {"tool_choice": "auto"}],
)
def test_nothing_to_constrain(constrain, fields):
    assert constrain(**fields) is None


def test_json_object_forces_an_object(constrain, walker, tiny_tokenizer):
    constraint = constrain(response_format={"type": "json_object"})
    assert tiny_tokenizer.decode(constraint.forced_tokens()) == "{"
    for seed in range(5):
        assert isinstance(json.loads(walker(constraint, seed)), dict)


def test_json_schema_forces_its_fixed_prefix(constrain, tiny_tokenizer):
    constraint = constrain(response_format=_schema_format(POINT))
    assert tiny_tokenizer.decode(constraint.forced_tokens()) == '{"x": '
    assert constraint.valid_prefix(tiny_tokenizer.encode('{"x": 1, "y": 2}')) == len(
        tiny_tokenizer.encode('{"x": 1, "y": 2}')
    )
    assert constraint.valid_prefix(tiny_tokenizer.encode('{"x":1}')) < len(tiny_tokenizer.encode('{"x":1}'))


def test_regex(constrain, walker, tiny_tokenizer):
    constraint = constrain(response_format={"type": "regex", "regex": r"\d{3}-\d{4}( ext\. \d+)?"})
    for seed in range(10):
        assert re.fullmatch(r"\d{3}-\d{4}( ext\. \d+)?", walker(constraint, seed))
    assert constraint.valid_prefix(tiny_tokenizer.encode("12a")) < 3
    assert constraint.valid_prefix(tiny_tokenizer.encode("\u0663")) == 0, "\\d means ASCII digits, as in JSON Schema"


def test_lark_grammar_with_inline_json(constrain, walker):
    grammar = 'start: "move " DIR " " %json {"type": "integer", "minimum": 1, "maximum": 9}\nDIR: "left" | "right"'
    constraint = constrain(response_format={"type": "grammar", "grammar": grammar})
    outputs = {walker(constraint, seed) for seed in range(20)}
    assert all(re.fullmatch(r"move (left|right) [1-9]", text) for text in outputs)
    assert len(outputs) > 2


def test_eos_only_once_the_grammar_accepts(constrain, tiny_tokenizer, eos_ids):
    constraint = constrain(response_format={"type": "regex", "regex": "ab+"})
    a, b = tiny_tokenizer.convert_tokens_to_ids(["a", "b"])
    assert not constraint.allowed_tokens()[list(eos_ids)].any()
    assert constraint.valid_prefix([a, min(eos_ids)]) == 1
    constraint.consume([a, b])
    assert constraint.allowed_tokens()[list(eos_ids)].all() and not constraint.is_finished
    constraint.consume([max(eos_ids)])
    assert constraint.is_finished and constraint.forced_tokens() == [] and constraint.valid_prefix([b]) == 0
    constraint.rollback(1)
    assert not constraint.is_finished and constraint.valid_prefix([b, b]) == 2


def test_grammar_completion_finishes_without_eos(constrain, tiny_tokenizer):
    constraint = constrain(response_format=_schema_format(POINT))
    constraint.consume(tiny_tokenizer.encode('{"x": 1, "y": 22}'))
    assert constraint.is_finished
    assert constraint.allowed_tokens().nonzero().flatten().tolist() == sorted(
        tiny_tokenizer.convert_tokens_to_ids([IM_END, END_OF_TEXT])
    )


def test_padding_ids_are_never_allowed(constrain, tiny_tokenizer):
    constraint = constrain(response_format={"type": "grammar", "grammar": "start: /(.|\\n)*/"})
    allowed = constraint.allowed_tokens()
    assert allowed.shape == (VOCAB,) and allowed[: len(tiny_tokenizer)].any()
    assert not allowed[len(tiny_tokenizer) :].any()


def test_mask_logits(constrain):
    constraint = constrain(response_format=_schema_format(POINT))
    allowed = constraint.allowed_tokens()
    for shape in [(VOCAB,), (3, VOCAB)]:
        logits = torch.randn(shape)
        original = logits.clone()
        assert constraint.mask_logits(logits) is logits
        assert torch.isneginf(logits[..., ~allowed]).all()
        assert torch.equal(logits[..., allowed], original[..., allowed])
    with pytest.raises(ValueError, match="wide"):
        constraint.mask_logits(torch.zeros(VOCAB - 1))


def test_span_masks_match_stepping_and_leave_state_alone(constrain, tiny_tokenizer, eos_ids):
    constraint = constrain(response_format=_schema_format(POINT))
    tokens = [*tiny_tokenizer.encode('{"x": 12, "y": 3}'), min(eos_ids)]
    before = (constraint.allowed_tokens(), constraint.forced_tokens())
    masks = constraint.span_masks(tokens)
    assert constraint.valid_prefix(tokens) == len(tokens)
    assert torch.equal(constraint.allowed_tokens(), before[0]) and constraint.forced_tokens() == before[1]
    assert masks.shape == (len(tokens) + 1, VOCAB)
    for i, token in enumerate(tokens):
        assert torch.equal(masks[i], constraint.allowed_tokens())
        assert masks[i, token]
        constraint.consume([token])
    eos_only = torch.zeros(VOCAB, dtype=torch.bool)
    eos_only[list(eos_ids)] = True
    assert torch.equal(masks[-1], eos_only)
    constraint.rollback(len(tokens))
    assert torch.equal(constraint.allowed_tokens(), before[0])


def test_greedy_is_the_masked_argmax_of_every_row(constrain, tiny_tokenizer):
    """What greedy verification keeps under a grammar: each row's argmax among the tokens allowed after the draft's
    prefix, whether the row's own argmax is allowed (read from the grammar's bits) or refused (the row masked), ties
    going to the first index as ``torch.argmax`` gives them."""
    constraint = constrain(response_format=_schema_format(POINT))
    draft = tiny_tokenizer.encode('{"x": 12')
    masks = constraint.span_masks(draft)
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(len(draft) + 1, VOCAB, generator=generator)
    for row, token in enumerate(draft):  # the draft's own tokens lead at even rows; a refused token at odd ones
        leader = token if row % 2 == 0 else int((~masks[row]).nonzero()[0])
        logits[row, leader] = 10.0
    allowed = masks[-1].nonzero().flatten()
    logits[-1, allowed[-1]] = logits[-1, allowed[1]] = 10.0  # a tie among allowed tokens
    expected = torch.argmax(logits.masked_fill(~masks, float("-inf")), dim=-1).tolist()
    assert constraint.greedy(logits, draft) == expected
    assert expected[-1] == int(allowed[1]) and expected[0] == draft[0]
    assert constraint.valid_prefix(draft) == len(draft) and constraint.span_masks(draft).equal(masks)


def test_draft_with_a_rejected_token(constrain, tiny_tokenizer, eos_ids):
    """DSpark's path: truncate the draft at valid_prefix; rows past a rejected token allow only EOS."""
    constraint = constrain(response_format=_schema_format(POINT))
    good = tiny_tokenizer.encode('{"x": 4')
    draft = [*good, tiny_tokenizer.convert_tokens_to_ids("a"), *tiny_tokenizer.encode("}")]
    assert constraint.valid_prefix(draft) == len(good)
    masks = constraint.span_masks(draft)
    assert not masks[len(good), draft[len(good)]]
    assert all(set(row.nonzero().flatten().tolist()) == eos_ids for row in masks[len(good) + 1 :])
    with pytest.raises(ConstraintError, match="not allowed"):
        constraint.consume(draft)
    assert constraint.valid_prefix(good) == len(good), "a rejected consume commits nothing"
    constraint.consume(good)
    with pytest.raises(ConstraintError, match="roll back"):
        constraint.rollback(len(good) + 1)
    constraint.rollback(2)
    assert constraint.valid_prefix(good[-2:]) == 2


def test_tokenizer_wrapper_is_cached_per_tokenizer(tiny_tokenizer, eos_ids):
    first = llg_tokenizer(tiny_tokenizer, VOCAB, eos_ids)
    assert llg_tokenizer(tiny_tokenizer, VOCAB, set(eos_ids)) is first
    assert llg_tokenizer(tiny_tokenizer, VOCAB + 8, eos_ids) is not first
    assert first.vocab_size == VOCAB and set(first.eos_tokens) == eos_ids


def _tool_schemas() -> dict[str, dict]:
    return {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in TOOLS}


def test_required_tool_call(constrain, walker, tiny_tokenizer):
    constraint = constrain(tools=TOOLS, tool_choice="required")
    assert tiny_tokenizer.decode(constraint.forced_tokens()) == '{"name": "'
    called = set()
    for seed in range(12):
        calls = parse_tool_calls(walker(constraint, seed), TOOLS)
        assert calls is not None and len(calls) == 1
        function = calls[0]["function"]
        jsonschema.validate(json.loads(function["arguments"]), _tool_schemas()[function["name"]])
        called.add(function["name"])
    assert len(called) > 1


def test_named_tool_choice(constrain, walker, tiny_tokenizer):
    constraint = constrain(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}})
    assert tiny_tokenizer.decode(constraint.forced_tokens()).startswith('{"name": "add", "arguments": {"a": ')
    for seed in range(5):
        (call,) = parse_tool_calls(walker(constraint, seed), TOOLS)
        assert call["function"]["name"] == "add"
        assert set(json.loads(call["function"]["arguments"])) == {"a", "b"}


def test_auto_allows_text_or_a_call(constrain, tiny_tokenizer, eos_ids):
    constraint = constrain(tools=TOOLS)
    assert constraint.forced_tokens() == []
    text = [*tiny_tokenizer.encode("It is sunny."), min(eos_ids)]
    call = tiny_tokenizer.encode('{"name": "now", "arguments": {}}')
    not_a_call = tiny_tokenizer.encode('{"weather": "sunny"}')
    assert constraint.valid_prefix(text) == len(text)
    assert constraint.valid_prefix([min(eos_ids)]) == 1, "an empty answer is an answer"
    assert constraint.valid_prefix(call) == len(call)
    assert constraint.valid_prefix(not_a_call) < len(not_a_call)
    constraint.consume(call)
    assert constraint.is_finished


def test_auto_with_a_json_answer(constrain, tiny_tokenizer):
    constraint = constrain(tools=TOOLS, tool_choice="auto", response_format=_schema_format(POINT))
    for text, ok in [('{"x": 1, "y": 2}', True), ('{"name": "now", "arguments": {}}', True), ("plain", False)]:
        tokens = tiny_tokenizer.encode(text)
        assert (constraint.valid_prefix(tokens) == len(tokens)) is ok, text


@pytest.mark.parametrize(
    ("fields", "param", "needle"),
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "sometimes"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools", "name"),
        ({"tools": [{"type": "retrieval"}]}, "tools", "tools[0]"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "twice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}]}, "tools", "foo"),
        ({"tools": TOOLS, "response_format": {"type": "grammar", "grammar": 'start: "x"'}}, "response_format", "Lark"),
    ],
)
def test_tool_refusals(constrain, fields, param, needle):
    with pytest.raises(UnsupportedFormatError, match=re.escape(needle)) as caught:
        constrain(**fields)
    assert caught.value.param == param


def test_parse_tool_calls():
    text = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
    (call,) = parse_tool_calls(text, TOOLS)
    assert call["type"] == "function" and re.fullmatch(r"call_[0-9a-f]{24}", call["id"])
    assert call["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    (again,) = parse_tool_calls(text, TOOLS)
    assert again["function"] == call["function"] and again["id"] != call["id"]  # the same call made twice: two ids
    for answer in ["It is sunny.", '{"name": "other", "arguments": {}}', '{"name": "add"}', "{", ""]:
        assert parse_tool_calls(answer, TOOLS) is None
    assert parse_tool_calls(text, None) is None


@pytest.mark.parametrize(
    ("text", "name", "arguments"),
    [
        ('{"name": "get_weather", "arguments": {"city": "Po', "get_weather", '{"city": "Po'),
        ('{"name": "get_weather", "arguments": ', "get_weather", ""),
        ('{"name": "get_weather",', "get_weather", ""),
        ('{"name": "get_wea', "get_weather", ""),  # only one tool starts so: the grammar allows nothing else
        ('{"name": "a', "add", ""),
        ('{"name": "n', "now", ""),
        ('{"name": "', "", ""),  # three tools are still possible
        ('{"na', "", ""),
    ],
)
def test_a_call_cut_short_keeps_its_name_and_partial_arguments(text, name, arguments):
    (call,) = cut_tool_call(text, TOOLS)
    assert call["function"] == {"name": name, "arguments": arguments} and call["id"].startswith("call_")
    assert cut_tool_call('{"name": "n', TOOLS[:2])[0]["function"]["name"] == "n"  # no tool starts so: as written


@pytest.mark.parametrize("text", ["It is", '{"answer": 4', "", "[1, 2"])
def test_text_cut_short_is_not_a_call(text):
    assert cut_tool_call(text, TOOLS) is None


def test_request_grammar_is_lark_text():
    grammar = request_grammar(_request(tools=TOOLS, tool_choice="required"))
    assert grammar.param == "tools" and grammar.lark.startswith("start: call\n")


def test_greedy_decoding_with_a_model(tiny_model_paths):
    """The AR call sequence on a real (random) model: forced tokens, masked logits, consume, stop when done."""
    loaded = load_model(tiny_model_paths["llama"], device="cpu")
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "digit": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["ok", "digit"],
        "additionalProperties": False,
    }
    request = _request(response_format=_schema_format(schema))
    vocab = loaded.model.get_output_embeddings().weight.shape[0]
    constraint = GrammarConstraint.from_request(request, loaded.tokenizer, vocab, loaded.eos_ids)
    ids = loaded.tokenizer.encode(request.prompt)
    generated: list[int] = []
    with torch.inference_mode():
        while not constraint.is_finished and len(generated) < 64:
            step = constraint.forced_tokens()
            if not step:
                logits = loaded.model(torch.tensor([ids + generated])).logits[0, -1]
                step = [int(constraint.mask_logits(logits).argmax())]
            constraint.consume(step)
            generated += step
    assert constraint.is_finished
    jsonschema.validate(json.loads(loaded.tokenizer.decode(generated, skip_special_tokens=True)), schema)


def test_follow_puts_the_grammars_forced_text_in_a_draft_and_after_it(constrain, tiny_tokenizer):
    """Plain decoding commits forced text without asking the model, so a draft walked through the grammar carries it
    flagged: where the draft wrote it too, the draft goes on; where it wrote something else, the forced text takes
    its place and the rest is dropped; where the draft stops, the forced text after it is appended. Nothing moves the
    grammar's state, and the walk stays within its limit."""
    constraint = constrain(response_format={"type": "regex", "regex": r"def-[0-9]{2}-return"})
    encode = tiny_tokenizer.encode
    answer = encode("def-12-return")
    start = constraint.forced_tokens()
    forced = [token in start or i >= 4 for i, token in enumerate(answer)]
    assert len(start) == 2 and forced == [True, True, False, False, True, True, True]

    whole = constraint.follow(answer, 64)
    assert (whole.tokens, whole.forced, whole.drafted, whole.refused) == (answer, forced, len(answer), False)
    prefix = constraint.follow(answer[:4], 64)  # the draft stops before "-return": it is appended
    assert (prefix.tokens, prefix.forced, prefix.drafted) == (answer, forced, 4)
    inside = constraint.follow(answer[:5], 64)  # the draft stops inside forced text, which it wrote as forced
    assert (inside.tokens, inside.drafted) == (answer, 5)
    other = constraint.follow(encode("de"), 64)  # not the forced tokens: they stand in the draft's place
    assert (other.tokens, other.forced, other.drafted) == (start, [True, True], 0)
    refused = constraint.follow(encode("def-1x"), 64)
    assert (refused.tokens, refused.drafted, refused.refused) == (answer[:3], 3, True)
    assert constraint.follow(answer, 4).tokens == answer[:4]
    assert constraint.follow([], 64).tokens == start
    assert constraint.forced_tokens() == start and constraint.valid_prefix(answer) == len(answer)


def test_a_block_the_grammar_cuts_is_marked_so_its_kind_learns_the_refused_token(constrain, tiny_tokenizer):
    """The decode loop counts the block's token the grammar stopped as rejected (`Proposal.cut_short`), whether it
    was refused or forced text stood in its place: a kind of block the grammar always cuts would otherwise be
    drafted every round and never learnt from. What the block earns is measured on its own tokens only, not on the
    forced text appended after it."""
    constraint = constrain(response_format={"type": "regex", "regex": r"\d{3}-\d{4}"})
    valid, invalid = tiny_tokenizer.encode("123-4567"), tiny_tokenizer.encode("12a-4567")
    whole = obeying(Proposal(valid), constraint, 64)
    assert whole.tokens == valid and not whole.cut_short and whole.learnt(len(valid)) == (len(valid), len(valid))
    short = obeying(Proposal(invalid), constraint, 64)
    kept = constraint.valid_prefix(invalid)
    assert short.tokens == invalid[:kept] and short.cut_short
    assert short.learnt(kept) == (kept + 1, kept) and short.learnt(0) == (kept, 0)
    assert not obeying(Proposal(invalid[:kept]), constraint, 64).cut_short  # the schedule stopped first
    assert obeying(Proposal(valid[:2]), None, 64).tokens == valid[:2]

    words = constrain(response_format={"type": "regex", "regex": r"def-[0-9]{2}-return"})
    answer = tiny_tokenizer.encode("def-12-return")
    appended = obeying(Proposal(answer[:4]), words, 64)
    assert appended.tokens == answer and not appended.cut_short and appended.learnt(len(answer)) == (4, 4)
    replaced = obeying(Proposal(tiny_tokenizer.encode("de")), words, 64)
    assert replaced.tokens == answer[:2] and replaced.cut_short and replaced.learnt(2) == (1, 0)


def test_the_schedule_cuts_a_walked_block_with_its_forced_text_certain(constrain, tiny_tokenizer):
    """Algorithm 1 chooses the length after the walk: forced text counts as certain once what precedes it is kept,
    the forced text a block starts with is always kept (the anchor before it is committed), and a cut before the
    token the grammar stopped neither counts that token nor keeps its distribution."""
    words = constrain(response_format={"type": "regex", "regex": r"def-[0-9]{2}-return"})
    answer = tiny_tokenizer.encode("def-12-return")
    rows = torch.rand(5, 8)
    block = obeying(Proposal(answer[:5], rows), words, 64)
    assert block.confidence([0.9, 0.8, 0.7, 0.6, 0.5]) == [1.0, 1.0, 0.7, 0.6, 1.0, 1.0, 1.0]
    assert block.confidence([]) == [] and Proposal(answer).confidence([0.5]) == [0.5]
    assert block.first(0).tokens == answer[:2] and block.first(3).tokens == answer[:3]
    three = block.first(3)
    assert three.probs.equal(rows[:3]) and three.own == 3 and three.forced == [True, True, False]
    assert block.first(7).tokens == answer and block.first(7).probs.equal(rows[:5])

    refused = obeying(Proposal(tiny_tokenizer.encode("def-1x"), torch.rand(4, 8)), words, 64)
    assert refused.refused is not None and refused.cut_short
    assert refused.first(3).refused is not None and refused.first(3).cut_short
    assert refused.first(2).refused is None and not refused.first(2).cut_short

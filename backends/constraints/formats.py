"""A request's ``response_format`` and ``tools`` as one llguidance grammar, or None when nothing is constrained.

Every grammar is written as Lark, with JSON schemas inlined through ``%json``: a tool call and a plain
answer can then be two alternatives of one grammar (``tool_choice="auto"``), and every kind of request
compiles through the same path.

JSON takes one fixed spelling: no free whitespace, ``", "`` and ``": "`` as separators (``json.dumps``'s
defaults). Free whitespace lets a weak model pad forever inside a valid document, and a single spelling per
value gives DSpark's draft heads one continuation to predict instead of several. ``lenient`` and
``coerce_one_of`` stay off whatever the schema's own ``x-guidance`` says: a keyword llguidance cannot enforce
makes the schema fail to compile, and is refused, rather than being ignored and letting invalid output through.
Before compiling, ``schemas.equivalent_schema`` rewrites the shapes of ``not``, ``oneOf`` and ``dependencies``
that have an exact equivalent llguidance does enforce.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from llguidance import regex_to_lark

from backends.constraints.schemas import equivalent_schema, unenforced_keyword
from backends.constraints.tools import call_schema, resolve_tool_choice
from backends.errors import UnsupportedFormatError
from backends.types import GenerationRequest

JSON_STYLE: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": False,
    "coerce_one_of": False,
}
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "regex", "grammar")
# \d and \w mean ASCII, as in JavaScript and JSON Schema's "pattern": the same regex constrains a regex
# response_format and a schema's string alike, and \d{3} does not admit digits from any script.
REGEX_ASCII_CLASSES = "dw"
# Free text beside a possible tool call: anything that does not open a JSON object, so a call is never
# mistaken for an answer and the model commits to one or the other at its first character.
FREE_TEXT = "answer: TEXT?\nTEXT: /[^{](.|\\n)*/\n"


@dataclass(frozen=True)
class Grammar:
    """Lark text for llguidance, and the request field to blame if it does not compile."""

    lark: str
    param: str


def request_grammar(request: GenerationRequest) -> Grammar | None:
    """The grammar a request's output must match; None when it may be any text.

    ``response_format`` is checked even when a tool call is required (and the format therefore unused), so a
    malformed request is refused whatever the model would have been asked to do.
    """
    kind, body = _response_format(request.response_format)
    choice = resolve_tool_choice(request.tools, request.tool_choice)
    if choice is None:
        if kind == "text":
            return None
        return Grammar(body if kind == "grammar" else f"start: {body}\n", "response_format")
    call = f"call: {json_rule(call_schema(choice.functions), 'tools')}\n"
    if choice.required:
        return Grammar(f"start: call\n{call}", "tools")
    if kind == "grammar":
        raise UnsupportedFormatError(
            "a Lark grammar response_format cannot be combined with optional tool calls; "
            'use tool_choice "none" or "required", or a json_schema or regex response_format',
            param="response_format",
        )
    answer = FREE_TEXT if kind == "text" else f"answer: {body}\n"
    return Grammar(f"start: answer | call\n{answer}{call}", "tools")


def json_rule(schema: dict[str, Any], param: str) -> str:
    """``schema`` as an inline Lark rule body, in the fixed JSON style (see the module docstring); a schema with a
    keyword llguidance would compile without enforcing is refused here, blaming ``param``."""
    rewritten = equivalent_schema(schema)
    if (problem := unenforced_keyword(rewritten)) is not None:
        raise UnsupportedFormatError(f"cannot constrain output to this {param}: {problem}", param=param)
    return f"%json {json.dumps({**rewritten, 'x-guidance': JSON_STYLE})}"


def _response_format(response_format: dict[str, Any] | None) -> tuple[str, str]:
    """The format's type and its Lark body: a rule expression, the whole grammar (``grammar``), or ``""``."""
    if response_format is None:
        return "text", ""
    kind = response_format.get("type")
    if kind == "text":
        return kind, ""
    if kind == "json_object":
        return kind, json_rule({"type": "object"}, "response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise UnsupportedFormatError(
                'response_format of type json_schema needs "json_schema": {"name": ..., "schema": {...}}, '
                "with the schema a JSON object",
                param="response_format",
            )
        return kind, json_rule(spec["schema"], "response_format")
    if kind in ("regex", "grammar"):
        text = response_format.get(kind)
        if not isinstance(text, str) or not text:
            raise UnsupportedFormatError(
                f'response_format of type {kind} needs a non-empty string in "{kind}"', param="response_format"
            )
        return kind, f"/{regex_to_lark(text, REGEX_ASCII_CLASSES)}/" if kind == "regex" else text
    raise UnsupportedFormatError(
        f"unsupported response_format type {kind!r}; use one of {', '.join(RESPONSE_FORMAT_TYPES)}",
        param="response_format",
    )

"""Tool calls: which functions a request lets the model call, the JSON a call takes, and reading calls back.

A call is one JSON object, ``{"name": "<tool>", "arguments": {...}}``: the shape chat models are commonly
tuned to emit, with the two fields OpenAI's ``tool_calls`` carry. The grammar pins ``name`` to the offered
tools and ``arguments`` to that tool's ``parameters`` schema, so every call that completes is one the client
can run; :func:`parse_tool_calls` then only has to reshape it. One call per completion: the request has no
``parallel_tool_calls``, and a grammar that ends right after the call lets the decoder stop there instead of
waiting for the model to emit EOS. A call cut short by ``max_tokens`` is still a call (:func:`cut_tool_call`), as
OpenAI returns it: the name and the arguments written so far, with ``finish_reason: "length"``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from backends.errors import UnsupportedFormatError
from backends.types import TOOL_CHOICE_FORMS

NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolChoice:
    """The functions the model may call (``{"name", "parameters"}`` each) and whether it must call one."""

    functions: tuple[dict[str, Any], ...]
    required: bool


def resolve_tool_choice(
    tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None
) -> ToolChoice | None:
    """What ``tools`` and ``tool_choice`` allow; None when no call may be made.

    ``tool_choice`` defaults to ``"auto"`` when tools are given, as in OpenAI's API. Malformed tools are
    refused even under ``"none"``: a request that is wrong should say so, whatever it asks the model to do.
    """
    functions = _functions(tools)
    if not functions:
        if tool_choice in (None, "none", "auto"):
            return None
        raise UnsupportedFormatError(
            f"tool_choice {tool_choice!r} needs tools, and none were given", param="tool_choice"
        )
    if tool_choice is None or tool_choice == "auto":
        return ToolChoice(functions, required=False)
    if tool_choice == "none":
        return None
    if tool_choice == "required":
        return ToolChoice(functions, required=True)
    name = _named_choice(tool_choice)
    chosen = tuple(f for f in functions if f["name"] == name)
    if not chosen:
        known = ", ".join(f["name"] for f in functions)
        raise UnsupportedFormatError(
            f"tool_choice names {name!r}, which is not among the tools ({known})", param="tool_choice"
        )
    return ToolChoice(chosen, required=True)


def call_schema(functions: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    """The JSON schema of one call to any of ``functions``: an anyOf with ``name`` as each branch's const.

    Each tool's parameters become a resource of their own (``$id``), so ``#/$defs/...`` references inside
    them still resolve once they are nested under ``arguments``.
    """
    variants = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "arguments": _as_resource(f["parameters"], index)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for index, f in enumerate(functions)
    ]
    return variants[0] if len(variants) == 1 else {"anyOf": variants}


def parse_tool_calls(text: str, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """OpenAI-shaped ``tool_calls`` when ``text`` is a call to one of ``tools``; None when it is an answer."""
    names = {f["name"] for f in _functions(tools)}
    try:
        call = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not (isinstance(call, dict) and call.get("name") in names and isinstance(call.get("arguments"), dict)):
        return None
    return [_tool_call(call["name"], json.dumps(call["arguments"], ensure_ascii=False))]


# The opening of a call as the grammar writes it: the name (perhaps cut) and, once it is closed, the arguments.
_CALL_OPENING = re.compile(
    r'\s*\{\s*"name"\s*:\s*"(?P<name>(?:[^"\\]|\\.)*)(?P<closed>"\s*(?:,\s*("arguments"\s*:\s*)?)?)?'
)


def cut_tool_call(text: str, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The call a completion cut by ``max_tokens`` had begun, or None when it had not begun one.

    The grammar only lets the name be one of the tools', so a name cut short that starts only one of them is
    completed to it: the model could have written nothing else. A name that is still ambiguous stays as written.
    The arguments are the JSON written so far, unfinished, as OpenAI sends them in the same case.
    """
    opening = _CALL_OPENING.match(text)
    if opening is None:
        squeezed = "".join(text.split())
        if not (squeezed and '{"name":"'.startswith(squeezed)):
            return None
        name, closed, arguments = "", False, ""
    else:
        name, closed = opening["name"], bool(opening["closed"])
        arguments = text[opening.end() :] if opening.group(3) else ""
    if not closed:
        candidates = [f["name"] for f in _functions(tools) if f["name"].startswith(name)]
        name = candidates[0] if len(candidates) == 1 else name
    return [_tool_call(name, arguments)]


def _tool_call(name: str, arguments: str) -> dict[str, Any]:
    """A fresh id per call, as OpenAI's: agent frameworks treat a call whose id they have seen as already run."""
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _functions(tools: list[dict[str, Any]] | None) -> tuple[dict[str, Any], ...]:
    functions: list[dict[str, Any]] = []
    for index, tool in enumerate(tools or ()):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise UnsupportedFormatError(f'{where} must be {{"type": "function", "function": {{...}}}}', param="tools")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise UnsupportedFormatError(f"{where}.function.name must be a non-empty string", param="tools")
        if any(f["name"] == name for f in functions):
            raise UnsupportedFormatError(f"{where}: the tool name {name!r} is used twice", param="tools")
        parameters = function.get("parameters", NO_PARAMETERS)
        if not isinstance(parameters, dict):
            raise UnsupportedFormatError(f"{where}.function.parameters must be a JSON schema object", param="tools")
        functions.append({"name": name, "parameters": parameters})
    return tuple(functions)


def _named_choice(tool_choice: str | dict[str, Any]) -> str:
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not (
        isinstance(tool_choice, dict)
        and tool_choice.get("type") == "function"
        and isinstance(function, dict)
        and isinstance(function.get("name"), str)
    ):
        raise UnsupportedFormatError(
            f"tool_choice must be {TOOL_CHOICE_FORMS}; got {tool_choice!r}",
            param="tool_choice",
        )
    return function["name"]


def _as_resource(parameters: dict[str, Any], index: int) -> dict[str, Any]:
    return parameters if "$id" in parameters else {"$id": f"urn:dspark-router:tool:{index}", **parameters}

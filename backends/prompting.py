"""How a request's response_format and tools reach the model: as compact notes in the system message.

Chat templates of small models have no place for tools or schemas, so the format and the tool signatures are
written into the system message. Every backend builds its prompts with it, and so does the drafters'
self-distillation (:mod:`backends.training.distill` sends its prompts through a backend), so the drafters learn
the target's answers to exactly what serving sends it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from typing import Any

SCHEMA_NOTE_CHARS = 600


def _type_name(schema: dict[str, Any]) -> str:
    return "|".join(map(str, schema["enum"])) if "enum" in schema else str(schema.get("type", "any"))


def format_instructions(response_format: dict[str, Any] | None, tools: Sequence[dict[str, Any]] | None) -> str | None:
    """The response format and tools in a few compact lines, or None when there are neither."""
    notes = []
    if tools:
        lines = []
        for tool in tools:
            function = tool.get("function", tool)
            properties = function.get("parameters", {}).get("properties", {})
            signature = ", ".join(f"{name}: {_type_name(schema)}" for name, schema in properties.items())
            lines.append(f"- {function['name']}({signature}): {function.get('description', '')}".rstrip(": "))
        notes.append('Call a tool by replying with JSON {"name": ..., "arguments": {...}}. Tools:\n' + "\n".join(lines))
    kind = (response_format or {}).get("type")
    if kind == "json_schema":
        notes.append(_schema_note(response_format.get("json_schema", {}).get("schema", {})))
    elif kind == "json_object":
        notes.append("Reply with a JSON object.")
    return "\n\n".join(notes) or None


def _schema_note(schema: Any) -> str:
    """The schema itself when it is short; past SCHEMA_NOTE_CHARS only its top-level keys, since a small
    model's context cannot hold a large schema and the grammar enforces the rest anyway."""
    text = json.dumps(schema, separators=(",", ":"))
    if len(text) <= SCHEMA_NOTE_CHARS:
        return f"Reply with JSON matching this schema: {text}"
    keys = list(schema.get("properties", {})) if isinstance(schema, dict) else []
    return f"Reply with JSON with the keys: {', '.join(keys)}" if keys else "Reply with JSON."


def prompt_messages(
    messages: Sequence[dict[str, Any]],
    response_format: dict[str, Any] | None = None,
    tools: Sequence[dict[str, Any]] | None = None,
) -> list[dict[str, str]]:
    """The messages as the model sees them: role and text only, with format and tool notes appended to the
    system message (one is added when there is none). Returns copies; the input is left alone."""
    out = [{"role": message["role"], "content": _message_text(message)} for message in messages]
    note = format_instructions(response_format, tools)
    if note is None:
        return out
    if out and out[0]["role"] == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{note}"
    else:
        out.insert(0, {"role": "system", "content": note})
    return out


def _message_text(message: dict[str, Any]) -> str:
    """An assistant's earlier tool calls written back as the JSON it replied with, so a template that knows only
    role and content (most small models') shows the model its own call before the tool's answer."""
    parts = [message["content"]] if message.get("content") else []
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        function = function if isinstance(function, dict) else {}
        arguments = function.get("arguments", "")
        with contextlib.suppress(json.JSONDecodeError):  # a call cut by max_tokens is shown as far as it went
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        parts.append(json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False))
    return "\n".join(parts)

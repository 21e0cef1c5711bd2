"""The request bodies of /openapi.json, derived from what the SDK's parsing accepts rather than written twice.

Endpoints read their bodies as plain JSON and hand them to the :class:`~router.sdk.Router`, which validates them
(``router/request.py``, ``backends/types.py``); FastAPI never validates a body. So the documented schema is built
from the same sources: the fields of :class:`~backends.types.GenerationRequest` (with its messages and options),
the routing and ignored arguments the parser lists, and the no-op values it accepts. A field added to the request
shows up here without an edit; ``additionalProperties: false`` is exact, since anything else is refused by name.
"""

from __future__ import annotations

from typing import Any

from backends.types import GenerationRequest
from router.request import IGNORED_ARGS, NO_OP_VALUES, ROUTING_ARGS

REF = "#/components/schemas/{model}"

# The arguments that only steer routing or the wire format: their types, for the docs (the parser checks them).
ROUTING_SCHEMAS: dict[str, dict[str, Any]] = {
    "model": {"type": "string", "description": "dspark-router/auto, or dspark-router/<pool> (or the bare pool name)"},
    "user": {"type": "string", "description": "the tenant, when metadata has no tenant"},
    "metadata": {
        "type": "object",
        "properties": {
            "route": {"type": "string", "description": "a pool to send the request to"},
            "tenant": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string"}, "description": "matched by rules' tags"},
        },
    },
    "stream": {"type": "boolean", "description": "answer as server-sent events"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "max_completion_tokens": {"type": "integer", "description": "OpenAI's newer name for max_tokens"},
}


def request_schemas() -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """The chat and text completion request schemas by name, and the component schemas they refer to."""
    generation = GenerationRequest.model_json_schema(ref_template=REF)
    components = generation.pop("$defs", {})
    fields = {name: spec for name, spec in generation["properties"].items() if name not in ("stream", "prompt")}
    extra = {name: ROUTING_SCHEMAS.get(name, {}) for name in sorted(ROUTING_ARGS | IGNORED_ARGS)}
    extra["max_completion_tokens"] = ROUTING_SCHEMAS["max_completion_tokens"]
    no_ops = {
        name: {"enum": list(values), "description": "accepted at its no-op value only"}
        for name, values in NO_OP_VALUES.items()
    }
    chat = {**fields, **extra, **no_ops}
    text = {name: spec for name, spec in chat.items() if name not in ("messages", "tools", "tool_choice")}
    text = {"prompt": {"type": "string", "description": "the text to continue, with no chat template"}, **text}
    schemas = {
        "ChatCompletionRequest": _object(chat, ["messages"]),
        "CompletionRequest": _object(text, ["prompt"]),
        "RouteRequest": _object(chat, ["messages"]),
    }
    return schemas, components


def _object(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def body(schema: str) -> dict[str, Any]:
    """An endpoint's ``openapi_extra``: a required JSON body of the named schema."""
    ref = {"$ref": REF.format(model=schema)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}

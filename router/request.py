"""OpenAI chat-completions arguments in; a backend request plus what the policy looks at out.

Arguments that change what a backend would generate are mapped; arguments that only steer routing (``model``,
``user``, ``metadata``) are kept beside the request. OpenAI arguments the backends cannot honour are accepted
at their no-op value (``n=1``, ``presence_penalty=0``, ...) and refused with the argument named otherwise, so a
client never silently gets something other than it asked for. Anything else is refused by name.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from backends.errors import InvalidRequestError
from backends.types import GenerationRequest

MODEL_PREFIX = "dspark-router/"
AUTO = "auto"
GENERATION_ARGS = frozenset(
    {
        "messages",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "response_format",
        "tools",
        "tool_choice",
        "dspark",
    }
)
ROUTING_ARGS = frozenset({"model", "user", "metadata", "stream"})
NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
}
IGNORED_ARGS = frozenset({"parallel_tool_calls", "stream_options", "service_tier", "store"})
ACCEPTED_ARGS = GENERATION_ARGS | ROUTING_ARGS | IGNORED_ARGS | {"max_completion_tokens"}


@dataclass(frozen=True)
class RoutedRequest:
    """A validated request with the routing facts pulled out of it."""

    request: GenerationRequest
    body: dict[str, Any]
    tenant: str | None = None
    hint: str | None = None
    tags: frozenset[str] = frozenset()
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def last_user_text(self) -> str:
        users = [m.content or "" for m in self.request.messages or [] if m.role == "user"]
        return users[-1] if users else ""

    @property
    def response_format_type(self) -> str:
        return (self.request.response_format or {}).get("type", "text")

    @property
    def has_tools(self) -> bool:
        return bool(self.request.tools)


def parse_openai_args(args: dict[str, Any], pools: frozenset[str]) -> RoutedRequest:
    """Validate chat-completions keyword arguments; ``pools`` are the names a route hint may use."""
    for name, value in args.items():
        if name in ACCEPTED_ARGS:
            continue
        if name in NO_OP_VALUES:
            if value not in NO_OP_VALUES[name]:
                allowed = " or ".join(repr(v) for v in NO_OP_VALUES[name] if v is not None)
                raise InvalidRequestError(f"{name}={value!r} is not supported; only {allowed}", param=name)
            continue
        raise InvalidRequestError(f"unknown argument {name!r}", param=name)
    if args.get("messages") is None:
        raise InvalidRequestError("messages is required", param="messages")
    fields = {k: v for k, v in args.items() if k in GENERATION_ARGS and v is not None}
    if args.get("max_completion_tokens") is not None:
        fields.setdefault("max_tokens", args["max_completion_tokens"])
    request = GenerationRequest(**fields, stream=bool(args.get("stream")))
    metadata = args.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise InvalidRequestError("metadata must be an object", param="metadata")
    tags = metadata.get("tags") or []
    if not isinstance(tags, list | tuple) or not all(isinstance(t, str) for t in tags):
        raise InvalidRequestError("metadata.tags must be a list of strings", param="metadata.tags")
    tenant = metadata.get("tenant") or args.get("user")
    if tenant is not None and not isinstance(tenant, str):
        raise InvalidRequestError("the tenant (metadata.tenant or user) must be a string", param="metadata.tenant")
    body = {k: v for k, v in args.items() if v is not None and k != "stream"}
    body["messages"] = [m.model_dump(exclude_none=True) for m in request.messages]
    return RoutedRequest(
        request=request,
        body=body,
        tenant=tenant,
        hint=_route_hint(args.get("model"), metadata.get("route"), pools),
        tags=frozenset(tags),
    )


def _route_hint(model: str | None, route: str | None, pools: frozenset[str]) -> str | None:
    """``model="dspark-router/<pool>"`` (or a bare pool name) and ``metadata.route`` name a pool; ``auto``: none."""
    from_model = model.removeprefix(MODEL_PREFIX) if model else None
    hints = {"model": None if from_model == AUTO else from_model, "metadata.route": route}
    for param, hint in hints.items():
        if hint is not None and hint not in pools:
            known = ", ".join(f"{MODEL_PREFIX}{p}" for p in [AUTO, *sorted(pools)])
            raise InvalidRequestError(f"{param} {hint!r} names no pool; use one of {known}", param=param)
    if hints["model"] and route and hints["model"] != route:
        raise InvalidRequestError(f"model asks for {hints['model']!r} but metadata.route for {route!r}", param="model")
    return hints["model"] or route

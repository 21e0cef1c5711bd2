"""OpenAI chat-completions arguments in (or a text completion's ``prompt``); a backend request plus what the policy
looks at out.

Arguments that change what a backend would generate are mapped; arguments that only steer routing (``model``,
``user``, ``metadata``) are kept beside the request. OpenAI arguments the backends cannot honour are accepted
at their no-op value (``n=1``, ``presence_penalty=0``, ...) and refused with the argument named otherwise, so a
client never silently gets something other than it asked for. Anything else is refused by name.

The SDK, the litellm provider and the REST gateway all come through here, so a body means the same to each of them.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from backends.errors import InvalidRequestError
from backends.types import GenerationRequest, check_text
from router.config import PoolConfig
from router.errors import ModelNotFoundError

MODEL_PREFIX = "dspark-router/"
AUTO = "auto"
GENERATION_ARGS = frozenset(
    {
        "messages",
        "prompt",
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
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
}
IGNORED_ARGS = frozenset({"parallel_tool_calls", "stream_options", "service_tier", "store"})
DEFAULTABLE_ARGS = ("temperature", "top_p", "max_tokens")
ACCEPTED_ARGS = GENERATION_ARGS | ROUTING_ARGS | IGNORED_ARGS | {"max_completion_tokens"}


@dataclass(frozen=True)
class RoutedRequest:
    """A validated request with the routing facts pulled out of it."""

    request: GenerationRequest
    body: dict[str, Any]
    unset: frozenset[str] = frozenset()
    tenant: str | None = None
    hint: str | None = None
    tags: frozenset[str] = frozenset()
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    principal: str | None = None
    """Who sent it as authenticated (the gateway's API key); None in-process and where the gateway has no keys."""

    @property
    def cache_scope(self) -> str | None:
        """Whose earlier answers the request drafts from (:mod:`backends.dspark.traffic`): the tenant, within the
        principal where there is one, so a client may narrow its scope by naming a tenant but never reach another
        principal's (the pair is encoded whole: no tenant name can spell another key's scope)."""
        if self.principal is None:
            return self.tenant
        return json.dumps([self.principal, self.tenant])

    @cached_property
    def template(self) -> str | None:
        """The request's template (:mod:`router.templates`): its cache scope with its system messages, response
        format and tools, hashed; None where it has none of the three (its text alone is no template). Kept once
        computed: the policy and the dispatcher both read it."""
        request = self.request
        system = [m.model_dump(exclude_none=True) for m in request.messages or [] if m.role in ("system", "developer")]
        if not system and not request.response_format and not request.tools:
            return None
        parts = [self.cache_scope, system, request.response_format, request.tools]
        return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()

    @property
    def last_user_text(self) -> str:
        """The last user message, or a text completion's prompt: what the rules' ``prompt_regex`` searches."""
        if self.request.prompt is not None:
            return self.request.prompt
        users = [m.content or "" for m in self.request.messages or [] if m.role == "user"]
        return users[-1] if users else ""

    @property
    def response_format_type(self) -> str:
        return (self.request.response_format or {}).get("type", "text")

    @property
    def has_tools(self) -> bool:
        return bool(self.request.tools)

    def for_pool(self, name: str, pool: PoolConfig) -> GenerationRequest:
        """The request as pool ``name`` decodes it: its defaults fill what is still unset, within its token cap."""
        update = {key: value for key, value in pool.defaults.values().items() if key in self.unset}
        if self.cache_scope is not None:
            update["cache_scope"] = self.cache_scope
        cap = pool.max_tokens
        if cap is not None:
            if "max_tokens" in self.unset:
                update["max_tokens"] = min(update.get("max_tokens", self.request.max_tokens), cap)
            elif self.request.max_tokens > cap:
                raise InvalidRequestError(
                    f"max_tokens {self.request.max_tokens} is above pool {name!r}'s cap of {cap}", param="max_tokens"
                )
        return self.request.model_copy(update=update) if update else self.request


def parse_openai_args(
    args: dict[str, Any], pools: frozenset[str], defaults: Mapping[str, Any] | None = None
) -> RoutedRequest:
    """Validate chat-completions keyword arguments; ``pools`` are the names a route hint may use.

    ``defaults`` (the policy's) stand in for arguments the client left out, before anything looks at the request,
    so rules, the classifier and the log see the values decoding will use. What is still unset after them is
    recorded in ``RoutedRequest.unset``: a pool's own defaults may fill exactly those.
    """
    unset = frozenset(name for name in DEFAULTABLE_ARGS if _unset(args, name))
    args = {**args, **{name: value for name, value in (defaults or {}).items() if name in unset}}
    for name, value in args.items():
        if name in ACCEPTED_ARGS:
            continue
        if name in NO_OP_VALUES:
            if value not in NO_OP_VALUES[name]:
                allowed = " or ".join(repr(v) for v in NO_OP_VALUES[name] if v is not None)
                raise InvalidRequestError(f"{name}={value!r} is not supported; only {allowed}", param=name)
            continue
        raise InvalidRequestError(f"unknown argument {name!r}", param=name)
    if args.get("messages") is None and args.get("prompt") is None:
        raise InvalidRequestError("messages is required (or prompt, for a text completion)", param="messages")
    check_text({k: v for k, v in args.items() if k not in GENERATION_ARGS})
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
    for name, value in (("metadata.tenant", metadata.get("tenant")), ("user", args.get("user"))):
        if value is not None and not isinstance(value, str):
            raise InvalidRequestError(f"{name} (the tenant) must be a string", param=name)
    tenant = metadata.get("tenant") or args.get("user")
    body = {k: v for k, v in args.items() if v is not None and k != "stream"}
    if request.messages is not None:
        body["messages"] = [m.model_dump(exclude_none=True) for m in request.messages]
    return RoutedRequest(
        request=request,
        body=body,
        unset=frozenset(name for name in unset if _unset(args, name)),
        tenant=tenant,
        hint=_route_hint(args.get("model"), metadata.get("route"), pools),
        tags=frozenset(tags),
    )


def _unset(args: Mapping[str, Any], name: str) -> bool:
    """``max_completion_tokens`` is OpenAI's newer name for ``max_tokens``: either one sets it."""
    aliases = ("max_tokens", "max_completion_tokens") if name == "max_tokens" else (name,)
    return all(args.get(alias) is None for alias in aliases)


def _route_hint(model: Any, route: Any, pools: frozenset[str]) -> str | None:
    """``model="dspark-router/<pool>"`` (or a bare pool name) and ``metadata.route`` name a pool; ``auto``: none."""
    for param, value in (("model", model), ("metadata.route", route)):
        if value is not None and not isinstance(value, str):
            raise InvalidRequestError(f"{param} must be a string, got {type(value).__name__}", param=param)
    from_model = model.removeprefix(MODEL_PREFIX) if model else None
    hints = {"model": None if from_model == AUTO else from_model, "metadata.route": route}
    for param, hint in hints.items():
        if hint is not None and hint not in pools:
            known = ", ".join(f"{MODEL_PREFIX}{p}" for p in [AUTO, *sorted(pools)])
            error = ModelNotFoundError if param == "model" else InvalidRequestError
            raise error(f"{param} {hint!r} names no pool; use one of {known}", param=param)
    if hints["model"] and route and hints["model"] != route:
        raise InvalidRequestError(f"model asks for {hints['model']!r} but metadata.route for {route!r}", param="model")
    return hints["model"] or route


def parse_body(text: str | bytes, *, source: str = "the body", param: str | None = None) -> dict[str, Any]:
    """A request body as the gateway and ``dspark-router route --request`` take it: one JSON object."""
    try:
        body = json.loads(text)
    except ValueError as exc:  # JSONDecodeError, and UnicodeDecodeError for bytes that are not UTF-8
        raise InvalidRequestError(f"{source} is not valid JSON: {exc}", param=param) from None
    except RecursionError:
        raise InvalidRequestError(f"{source} is nested too deeply to parse", param=param) from None
    if not isinstance(body, dict):
        raise InvalidRequestError(f"{source} must be a JSON object, not {type(body).__name__}", param=param)
    return body

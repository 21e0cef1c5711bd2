"""litellm the other way round: a custom provider so that ``litellm.completion(model="dspark-router/auto", ...)``
runs through a :class:`~router.sdk.Router` in this process.

``dspark-router/auto`` lets the policy decide; ``dspark-router/<pool>`` (``dspark``, ``standard``) is a route hint.
litellm passes ``metadata`` through, so ``metadata={"route": ..., "tenant": ..., "tags": [...]}`` works as with
the SDK, and ``user`` becomes the tenant. The decision rides on the response's message as
``provider_specific_fields["dspark_router"]``. Router errors need no translation: litellm maps an exception by its
``status_code``, so a refused request arrives as ``litellm.BadRequestError`` (an unknown model as ``NotFoundError``),
full queues as ``RateLimitError``, a pool's failure as ``BadGatewayError`` (``InternalServerError`` for a model
that cannot load) and a timeout as ``litellm.Timeout``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

from router.decisions import RoutedResult
from router.litellm_backend import import_litellm

if TYPE_CHECKING:
    from router.sdk import Router

PROVIDER = "dspark-router"
FINISH_REASONS = {"eos": "stop"}


def register(router: Router, provider: str = PROVIDER) -> Any:
    """Make ``<provider>/...`` models run through ``router``; registering again replaces the earlier router."""
    litellm = import_litellm()
    handler = _provider_class(litellm)(router)
    entries = [e for e in litellm.custom_provider_map if e.get("provider") != provider]
    litellm.custom_provider_map = [*entries, {"provider": provider, "custom_handler": handler}]
    return handler


def _provider_class(litellm: Any) -> type:
    """The provider subclasses litellm.CustomLLM, so it is defined only once litellm is imported."""

    class RouterProvider(litellm.CustomLLM):
        def __init__(self, router: Router) -> None:
            super().__init__()
            self.router = router

        def completion(self, model: str, messages: list, model_response: Any, optional_params: dict, **kw: Any) -> Any:
            result = self.router.complete(**_router_args(model, messages, optional_params, kw))
            return _fill_response(litellm, model_response, result)

        async def acompletion(
            self, model: str, messages: list, model_response: Any, optional_params: dict, **kw: Any
        ) -> Any:
            result = await self.router.acomplete(**_router_args(model, messages, optional_params, kw))
            return _fill_response(litellm, model_response, result)

        def streaming(self, model: str, messages: list, optional_params: dict, **kw: Any) -> Iterator[dict[str, Any]]:
            for chunk in self.router.stream(**_router_args(model, messages, optional_params, kw)):
                yield _generic_chunk(chunk.delta, chunk.result)

        async def astreaming(
            self, model: str, messages: list, optional_params: dict, **kw: Any
        ) -> AsyncIterator[dict[str, Any]]:
            async for chunk in self.router.astream(**_router_args(model, messages, optional_params, kw)):
                yield _generic_chunk(chunk.delta, chunk.result)

    return RouterProvider


def _router_args(model: str, messages: list, optional_params: dict, kw: dict[str, Any]) -> dict[str, Any]:
    """litellm's call back into SDK arguments: its optional params, plus metadata and user, which it keeps apart."""
    args = {k: v for k, v in optional_params.items() if k not in ("stream", "stream_options")}
    metadata = (kw.get("litellm_params") or {}).get("metadata")
    user = getattr(kw.get("logging_obj"), "model_call_details", {}).get("user")
    extra = {"metadata": metadata, "user": user}
    return {"model": model, "messages": messages, **args, **{k: v for k, v in extra.items() if v is not None}}


def _fill_response(litellm: Any, response: Any, result: RoutedResult) -> Any:
    choice = response.choices[0]
    choice.message.content = result.text
    if result.tool_calls:
        choice.message.tool_calls = result.tool_calls
    choice.message.provider_specific_fields = {"dspark_router": result.decision.model_dump()}
    choice.finish_reason = FINISH_REASONS.get(result.finish_reason, result.finish_reason)
    usage = result.usage
    response.usage = litellm.Usage(
        prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens, total_tokens=usage.total_tokens
    )
    return response


def _generic_chunk(delta: str, result: RoutedResult | None) -> dict[str, Any]:
    """litellm's GenericStreamingChunk: text deltas, then a last chunk with the finish reason and usage."""
    if result is None:
        return {"text": delta, "is_finished": False, "finish_reason": "", "usage": None, "index": 0, "tool_use": None}
    usage = result.usage
    return {
        "text": delta,
        "is_finished": True,
        "finish_reason": FINISH_REASONS.get(result.finish_reason, result.finish_reason),
        "usage": {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
        },
        "index": 0,
        "tool_use": None,
        "provider_specific_fields": {"dspark_router": result.decision.model_dump()},
    }

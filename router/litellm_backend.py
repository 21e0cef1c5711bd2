"""A standard pool served elsewhere, through litellm: ``openai/<model>`` with an ``api_base``, ``hosted_vllm/...``,
or any other provider litellm speaks, behind the same Backend protocol as the local decoders.

Remote servers report no token ids and no decode internals, so a result carries the text, usage, finish reason
and what the router can time itself (wall time, time to first token, tokens per second). litellm's own retries
are off: a failing server should surface at once, as a typed error the router can fall back from.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

from backends.errors import BackendError, DSparkRouterError, InvalidRequestError
from backends.types import FinishReason, GenerationRequest, GenerationResult, GenerationStats, StreamChunk, Usage
from router.errors import PoolTimeoutError

FINISH_REASONS: dict[str, FinishReason] = {
    "stop": "stop",
    "eos": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
    "function_call": "tool_calls",
}


def import_litellm() -> Any:
    """litellm fetches a price list from the internet at import unless told not to. The router needs no prices and
    often runs offline, where that fetch and its retries stall start-up for many seconds."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    return litellm


@contextmanager
def typed_errors(model: str) -> Iterator[None]:
    """litellm's exceptions as the project's: a refused request stays a request error, the rest may fall back."""
    litellm = import_litellm()
    try:
        yield
    except DSparkRouterError:
        raise
    except litellm.Timeout as exc:
        raise PoolTimeoutError(f"{model}: {exc}") from exc
    except (litellm.BadRequestError, litellm.UnprocessableEntityError) as exc:
        raise InvalidRequestError(f"{model} refused the request: {exc}") from exc
    except Exception as exc:
        raise BackendError(f"{model}: {type(exc).__name__}: {exc}") from exc


class LiteLLMBackend:
    name = "litellm"

    def __init__(
        self, model: str, *, api_base: str | None = None, api_key: str | None = None, timeout_s: float = 120.0
    ) -> None:
        self.model = model
        self.api_base = api_base
        self.api_key = api_key
        self.timeout_s = timeout_s
        self._litellm = import_litellm()

    def complete(self, request: GenerationRequest) -> GenerationResult:
        started = time.perf_counter()
        with typed_errors(self.model):
            response = self._litellm.completion(**self._args(request, stream=False))
        return _result_from_response(response, started)

    async def acomplete(self, request: GenerationRequest) -> GenerationResult:
        started = time.perf_counter()
        with typed_errors(self.model):
            response = await self._litellm.acompletion(**self._args(request, stream=False))
        return _result_from_response(response, started)

    def stream(self, request: GenerationRequest) -> Iterator[StreamChunk]:
        assembler = _StreamAssembler()
        with typed_errors(self.model):
            for chunk in self._litellm.completion(**self._args(request, stream=True)):
                if delta := assembler.add(chunk):
                    yield StreamChunk(delta=delta)
        yield assembler.final()

    async def astream(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        assembler = _StreamAssembler()
        with typed_errors(self.model):
            async for chunk in await self._litellm.acompletion(**self._args(request, stream=True)):
                if delta := assembler.add(chunk):
                    yield StreamChunk(delta=delta)
        yield assembler.final()

    def _args(self, request: GenerationRequest, *, stream: bool) -> dict[str, Any]:
        if request.messages is None:
            raise InvalidRequestError("litellm pools serve chat messages; send messages, not prompt", param="prompt")
        args: dict[str, Any] = {
            "model": self.model,
            "messages": [m.model_dump(exclude_none=True) for m in request.messages],
            "max_tokens": request.max_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "timeout": self.timeout_s,
            "num_retries": 0,
            "max_retries": 0,
        }
        optional = {
            "seed": request.seed,
            "stop": request.stop or None,
            "response_format": request.response_format,
            "tools": request.tools,
            "tool_choice": request.tool_choice,
            "api_base": self.api_base,
            "api_key": self.api_key,
            "extra_body": {"top_k": request.top_k} if request.top_k else None,
        }
        args.update({k: v for k, v in optional.items() if v is not None})
        if stream:
            args.update(stream=True, stream_options={"include_usage": True})
        return args


def _finish_reason(reason: str | None) -> FinishReason:
    return FINISH_REASONS.get(reason or "stop", "stop")


def _usage(usage: Any) -> Usage:
    if usage is None:
        return Usage(prompt_tokens=0, completion_tokens=0)
    return Usage(prompt_tokens=usage.prompt_tokens or 0, completion_tokens=usage.completion_tokens or 0)


def _stats(usage: Usage, started: float, first_token_at: float | None) -> GenerationStats:
    wall = time.perf_counter() - started
    return GenerationStats(
        wall_time_s=wall,
        time_to_first_token_s=(first_token_at - started) if first_token_at is not None else None,
        tokens_per_s=usage.completion_tokens / wall if wall else 0.0,
    )


def _result_from_response(response: Any, started: float) -> GenerationResult:
    choice = response.choices[0]
    message = choice.message
    tool_calls = [call.model_dump() for call in message.tool_calls] if message.tool_calls else None
    usage = _usage(getattr(response, "usage", None))
    return GenerationResult(
        text=message.content or "",
        token_ids=[],
        finish_reason=_finish_reason(choice.finish_reason),
        usage=usage,
        stats=_stats(usage, started, None),
        tool_calls=tool_calls,
    )


class _StreamAssembler:
    """Collects a litellm stream: text, tool-call fragments by index, the finish reason and the usage."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.first_token_at: float | None = None
        self.text: list[str] = []
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.finish_reason: str | None = None
        self.usage: Any = None

    def add(self, chunk: Any) -> str:
        self.usage = getattr(chunk, "usage", None) or self.usage
        if not chunk.choices:
            return ""
        choice = chunk.choices[0]
        self.finish_reason = choice.finish_reason or self.finish_reason
        for call in choice.delta.tool_calls or []:
            slot = self.tool_calls.setdefault(
                call.index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
            )
            slot["id"] = call.id or slot["id"]
            slot["function"]["name"] += call.function.name or ""
            slot["function"]["arguments"] += call.function.arguments or ""
        delta = choice.delta.content or ""
        if delta:
            self.first_token_at = self.first_token_at or time.perf_counter()
            self.text.append(delta)
        return delta

    def final(self) -> StreamChunk:
        usage = _usage(self.usage)
        result = GenerationResult(
            text="".join(self.text),
            token_ids=[],
            finish_reason=_finish_reason(self.finish_reason),
            usage=usage,
            stats=_stats(usage, self.started, self.first_token_at),
            tool_calls=[self.tool_calls[i] for i in sorted(self.tool_calls)] or None,
        )
        return StreamChunk(delta="", finish_reason=result.finish_reason, result=result)

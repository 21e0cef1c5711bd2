"""Routed results as OpenAI's response bodies: ``chat.completion``, ``chat.completion.chunk``, ``text_completion``.

The models here are the gateway's output contract (its OpenAPI response schemas come from them) and carry nothing
that is not in a :class:`~router.decisions.RoutedResult`. Two additions to OpenAI's shape, both extra fields that
OpenAI clients keep and ignore: ``usage.dspark`` (what DSpark decoding did) and ``dspark_router`` (the decision
and the router's own measurements) on a whole completion.

A stream may turn out to be a tool call, which OpenAI sends as ``tool_calls`` deltas rather than text. A call is
one JSON object and a plain answer beside tools never opens with ``{`` (the grammar sees to it,
``backends/constraints/formats.py``), so text that opens with ``{`` is held until the result says whether it parsed
as a call: then it goes out as the call (its id, name, then its arguments), otherwise as the text it was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from router.decisions import Decision, Measured, RoutedResult
from router.request import MODEL_PREFIX

# The backends' "eos" (the model ended on its own) is OpenAI's "stop", as in router/litellm_provider.py.
FINISH_REASONS = {"eos": "stop"}


def finish_reason(result: RoutedResult) -> str:
    return FINISH_REASONS.get(result.finish_reason, result.finish_reason)


def served_model(decision: Decision) -> str:
    """The route hint that names the pool that served: sending it back as ``model`` reaches the same pool."""
    return f"{MODEL_PREFIX}{decision.pool}"


class DSparkUsage(BaseModel):
    mean_accepted_tokens: float | None = Field(description="tokens committed per forward pass (1.0 for plain decoding)")
    forward_passes: int
    forced_tokens: int = Field(description="tokens the grammar forced, appended without a forward pass")
    traffic_rounds: int = Field(
        default=0, description="rounds that verified a draft from the pool's earlier answers (this caller's scope)"
    )
    datastore_rounds: int = Field(
        default=0, description="rounds that verified a draft from the target's own answers shipped with its drafters"
    )
    tree_rounds: int = Field(default=0, description="rounds that verified several drafts as one token tree")


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="the prompt's first tokens the engine's prefix cache held (not prefilled)")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    dspark: DSparkUsage


class RouterInfo(BaseModel):
    decision: Decision
    measured: Measured


def usage(result: RoutedResult) -> Usage:
    counts, spans = result.usage, result.stats.spans
    return Usage(
        prompt_tokens=counts.prompt_tokens,
        completion_tokens=counts.completion_tokens,
        total_tokens=counts.total_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=result.stats.cached_prompt_tokens),
        dspark=DSparkUsage(
            mean_accepted_tokens=result.measured.mean_accepted_tokens,
            forward_passes=result.stats.forward_passes,
            forced_tokens=result.stats.forced_tokens,
            traffic_rounds=spans.traffic_rounds if spans else 0,
            datastore_rounds=spans.datastore_rounds if spans else 0,
            tree_rounds=spans.tree_rounds if spans else 0,
        ),
    )


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="the arguments as a JSON string, as OpenAI sends them")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None
    refusal: None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: None = None
    dspark_router: RouterInfo


class TextChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str
    logprobs: None = None


class TextCompletion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage
    dspark_router: RouterInfo


def chat_completion(result: RoutedResult, created: int) -> ChatCompletion:
    calls = [ToolCall.model_validate(call) for call in result.tool_calls or []]
    message = AssistantMessage(content=None if calls else result.text, tool_calls=calls or None)
    return ChatCompletion(
        id=f"chatcmpl-{result.request_id}",
        created=created,
        model=served_model(result.decision),
        choices=[ChatChoice(message=message, finish_reason=finish_reason(result))],
        usage=usage(result),
        dspark_router=RouterInfo(decision=result.decision, measured=result.measured),
    )


def text_completion(result: RoutedResult, created: int) -> TextCompletion:
    return TextCompletion(
        id=f"cmpl-{result.request_id}",
        created=created,
        model=served_model(result.decision),
        choices=[TextChoice(text=result.text, finish_reason=finish_reason(result))],
        usage=usage(result),
        dspark_router=RouterInfo(decision=result.decision, measured=result.measured),
    )


class _Delta(BaseModel):
    """Only what a chunk adds, as OpenAI sends it: ``{"content": "..."}``, not a row of nulls."""

    model_config = ConfigDict(json_schema_mode_override="validation")

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class FunctionDelta(_Delta):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Delta):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta


class ChatDelta(_Delta):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: None = None


class TextChunkChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: None = None


class TextCompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[TextChunkChoice]
    usage: Usage | None = None


class Chunks(Protocol):
    """What a stream of one endpoint sends: before the first delta, per delta, and once the result is in."""

    def opening(self) -> list[BaseModel]: ...

    def delta(self, text: str) -> list[BaseModel]: ...

    def closing(self, tail: str, result: RoutedResult) -> list[BaseModel]: ...


def _include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


class ChatChunks:
    """One chat stream's chunks: the role first, content (or a tool call) as it comes, the finish, the usage."""

    def __init__(self, request_id: str, created: int, decision: Decision, body: dict[str, Any]) -> None:
        self._head = {"id": f"chatcmpl-{request_id}", "created": created, "model": served_model(decision)}
        self._include_usage = _include_usage(body)
        self._tools = bool(body.get("tools")) and body.get("tool_choice") != "none"
        self._held: list[str] | None = None

    def opening(self) -> list[BaseModel]:
        return [self._chunk(ChatDelta(role="assistant", content=""))]

    def delta(self, text: str) -> list[BaseModel]:
        if self._held is None and self._tools and text.startswith("{"):
            self._held = []
        if self._held is not None:
            self._held.append(text)
            return []
        return [self._chunk(ChatDelta(content=text))] if text else []

    def closing(self, tail: str, result: RoutedResult) -> list[BaseModel]:
        if result.tool_calls:
            chunks = [chunk for i, call in enumerate(result.tool_calls) for chunk in self._call(i, call)]
        else:
            text = "".join(self._held or []) + tail
            chunks = [self._chunk(ChatDelta(content=text))] if text else []
        chunks.append(self._chunk(ChatDelta(), finish_reason(result)))
        if self._include_usage:
            chunks.append(ChatCompletionChunk(**self._head, choices=[], usage=usage(result)))
        return chunks

    def _call(self, index: int, call: dict[str, Any]) -> list[BaseModel]:
        name, arguments = call["function"]["name"], call["function"]["arguments"]
        start = ToolCallDelta(index=index, id=call["id"], type="function", function=FunctionDelta(name=name))
        arguments = ToolCallDelta(index=index, function=FunctionDelta(arguments=arguments))
        return [self._chunk(ChatDelta(tool_calls=[start])), self._chunk(ChatDelta(tool_calls=[arguments]))]

    def _chunk(self, delta: ChatDelta, finish: str | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(**self._head, choices=[ChatChunkChoice(delta=delta, finish_reason=finish)])


class TextChunks:
    """One text completion stream's chunks: text as it comes, the finish, the usage."""

    def __init__(self, request_id: str, created: int, decision: Decision, body: dict[str, Any]) -> None:
        self._head = {"id": f"cmpl-{request_id}", "created": created, "model": served_model(decision)}
        self._include_usage = _include_usage(body)

    def opening(self) -> list[BaseModel]:
        return []

    def delta(self, text: str) -> list[BaseModel]:
        return [self._chunk(text)] if text else []

    def closing(self, tail: str, result: RoutedResult) -> list[BaseModel]:
        chunks: list[BaseModel] = [self._chunk(tail, finish_reason(result))]
        if self._include_usage:
            chunks.append(TextCompletionChunk(**self._head, choices=[], usage=usage(result)))
        return chunks

    def _chunk(self, text: str, finish: str | None = None) -> TextCompletionChunk:
        return TextCompletionChunk(**self._head, choices=[TextChunkChoice(text=text, finish_reason=finish)])


@dataclass(frozen=True)
class Endpoint:
    """One completions endpoint: the input it takes, its whole-completion body and its stream's chunks."""

    takes: Literal["messages", "prompt"]
    whole: Callable[[RoutedResult, int], BaseModel]
    chunks: Callable[[str, int, Decision, dict[str, Any]], Chunks]


CHAT = Endpoint("messages", chat_completion, ChatChunks)
TEXT = Endpoint("prompt", text_completion, TextChunks)

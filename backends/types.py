"""Request and result types that every backend, the router and the gateway share.

The request mirrors the OpenAI chat-completions arguments, so the SDK, litellm and the gateway can hand
it over unchanged. It is validated on construction and every failure names its field through
:class:`~backends.errors.InvalidRequestError`, never a bare pydantic error.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from backends.errors import InvalidRequestError

MAX_TOKENS_LIMIT = 32_768
MAX_STOP_STRINGS = 4

FinishReason = Literal["stop", "length", "eos", "tool_calls"]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class DSparkOptions(BaseModel):
    """Per-request DSpark decoding options; anything left out takes the pool's setting."""

    model_config = ConfigDict(extra="forbid")

    max_span: int | None = Field(default=None, ge=1, le=16)
    thresholds: dict[int, float] | None = None
    verification: Literal["exact", "confidence"] | None = None

    @field_validator("thresholds")
    @classmethod
    def _check_thresholds(cls, value: dict[int, float] | None) -> dict[int, float] | None:
        if value is not None and any(not 0.0 <= t <= 1.0 or length < 2 for length, t in value.items()):
            raise ValueError("thresholds map span lengths >= 2 to confidences in [0, 1]")
        return value


class GenerationRequest(BaseModel):
    """One subtask for a backend: either a raw ``prompt`` or chat ``messages``."""

    model_config = ConfigDict(extra="forbid")

    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    stream: bool = False
    dspark: DSparkOptions | None = None

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise _as_invalid_request(exc) from None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        if value is None:
            return []
        return [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: list[str]) -> list[str]:
        if len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(value)}")
        if any(s == "" for s in value):
            raise ValueError("stop strings must be non-empty")
        return value

    @field_validator("max_tokens")
    @classmethod
    def _check_max_tokens(cls, value: int) -> int:
        if not 1 <= value <= MAX_TOKENS_LIMIT:
            raise ValueError(f"max_tokens must be between 1 and {MAX_TOKENS_LIMIT}, got {value}")
        return value

    @field_validator("temperature")
    @classmethod
    def _check_temperature(cls, value: float) -> float:
        if not 0.0 <= value <= 2.0:
            raise ValueError(f"temperature must be between 0 and 2, got {value}")
        return value

    @field_validator("top_p")
    @classmethod
    def _check_top_p(cls, value: float) -> float:
        if not 0.0 < value <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {value}")
        return value

    @field_validator("top_k")
    @classmethod
    def _check_top_k(cls, value: int) -> int:
        if value < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {value}")
        return value

    @model_validator(mode="after")
    def _check_input(self) -> GenerationRequest:
        if self.messages is not None and self.prompt is not None:
            raise InvalidRequestError("give either prompt or messages, not both", param="messages")
        if self.messages is not None:
            if not self.messages:
                raise InvalidRequestError("messages must not be empty", param="messages")
            if all(not (m.content or m.tool_calls) for m in self.messages):
                raise InvalidRequestError("every message is empty", param="messages")
        elif not self.prompt:
            raise InvalidRequestError("prompt must be a non-empty string (or give messages)", param="prompt")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _as_invalid_request(exc: ValidationError) -> InvalidRequestError:
    first = exc.errors()[0]
    field = ".".join(str(p) for p in first["loc"]) or None
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, InvalidRequestError):
        return cause
    message = first["msg"].removeprefix("Value error, ")
    return InvalidRequestError(f"{field}: {message}" if field else message, param=field)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class SpanStats(BaseModel):
    """What the DSpark decode loop did: the numbers the router learns from and the benchmark reports."""

    mean_accepted: float = 0.0
    acceptance_by_offset: list[float] = Field(default_factory=list)
    proposed_span_hist: dict[int, int] = Field(default_factory=dict)
    accepted_span_hist: dict[int, int] = Field(default_factory=dict)
    cleared_threshold: dict[int, int] = Field(default_factory=dict)
    fallback_steps: int = 0
    steps: int = 0

    @property
    def fallback_rate(self) -> float:
        return self.fallback_steps / self.steps if self.steps else 0.0


class GenerationStats(BaseModel):
    forward_passes: int = 0
    wall_time_s: float = 0.0
    time_to_first_token_s: float | None = None
    tokens_per_s: float = 0.0
    forced_tokens: int = 0
    constraint_s: float = 0.0
    spans: SpanStats | None = None


class GenerationResult(BaseModel):
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage
    stats: GenerationStats
    tool_calls: list[dict[str, Any]] | None = None


class StreamChunk(BaseModel):
    """One streamed piece: a text delta, and on the last chunk the finish reason and the full result."""

    delta: str
    finish_reason: FinishReason | None = None
    result: GenerationResult | None = None

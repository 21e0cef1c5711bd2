"""Request and result types that every backend, the router and the gateway share.

The request mirrors the OpenAI chat-completions arguments, so the SDK, litellm and the gateway can hand
it over unchanged. It is validated on construction and every failure names its field through
:class:`~backends.errors.InvalidRequestError`, never a bare pydantic error.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from backends.errors import InvalidRequestError
from backends.scheduling import Lookup
from backends.traffic_settings import TrafficOptions

MAX_TOKENS_LIMIT = 32_768
TOOL_CHOICE_FORMS = '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
MAX_STOP_STRINGS = 4
CACHES = ("prefix", "traffic", "datastore")
"""The caches a local backend keeps, by the name its metrics give them: prompt prefixes' keys and values
(:mod:`backends.packed.prefix_cache`) and, in a DSpark pool, earlier answers to draft from
(:mod:`backends.dspark.traffic`) and the target's shipped answers (:mod:`backends.dspark.datastore`)."""
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
"""What a torch generator takes; a seed outside it is the request's fault, refused before it reaches a pool."""
# OpenAI's defaults for sampling arguments a client leaves out. Decoding, routing rules, classifier features,
# calibration and decision records all read them from here, so an unset temperature means one thing everywhere;
# a pool or policy that wants another default says so in its config (``defaults: {temperature: 0}``).
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
DEFAULT_MAX_TOKENS = 256

FinishReason = Literal["stop", "length", "eos", "tool_calls"]


# What a message's content may be on the wire; after validation it is always text (or None).
CONTENT_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {"type": "string"},
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                "required": ["type", "text"],
            },
        },
        {"type": "null"},
    ]
}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Annotated[str | None, WithJsonSchema(CONTENT_SCHEMA)] = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = Field(default=None, validate_default=True)

    @field_validator("tool_call_id")
    @classmethod
    def _tool_replies_name_their_call(cls, value: str | None, info: ValidationInfo) -> str | None:
        """An agent loop that loses the pairing of a reply with its call would feed the model a dangling result."""
        if info.data.get("role") == "tool" and not value:
            raise ValueError("a message with role 'tool' must carry the tool_call_id of the call it answers")
        return value

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_as_text(cls, value: Any) -> Any:
        """LangChain and the Agents SDK send content as a list of parts. Text parts are joined one per line (as
        vLLM does), so every backend, rule and classifier keeps seeing one string; any other part (an image, audio,
        a file) is refused by its index and type, since no model here can read it and dropping it would answer
        a different question than the one asked."""
        if not isinstance(value, list):
            return value
        texts = []
        for index, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                what = f"of type {kind!r}" if isinstance(kind, str) else "not a content part"
                raise ValueError(f"content[{index}] is {what}; only text parts ({{'type': 'text', ...}}) can be read")
            texts.append(part["text"])
        return "\n".join(texts)


class DSparkOptions(BaseModel):
    """Per-request DSpark decoding options; anything left out takes the pool's setting."""

    model_config = ConfigDict(extra="forbid")

    max_span: int | None = Field(default=None, ge=1, le=16)
    thresholds: dict[int, float] | None = None
    verification: Literal["exact", "confidence"] | None = None
    drafter: Literal["heads", "dspark"] | None = Field(
        default=None, description="span heads, or the published DSpark drafter (parallel backbone + Markov head)"
    )
    confidence_threshold: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="dspark drafter: verify up to the first c_k below this instead of the hardware-aware schedule",
    )
    lookup: Lookup | None = Field(
        default=None,
        description="dspark drafter: blocks copied from the context (n-gram lookup) beside the drafter's, "
        "whichever has been accepted more in this request, or only those",
    )
    traffic: TrafficOptions | None = Field(
        default=None, description="dspark drafter: drafting from the pool's earlier answers (default: the pool's)"
    )
    trees: bool | None = Field(
        default=None,
        description="dspark drafter: looked-up blocks that disagree verified together as one token tree",
    )

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
    max_tokens: StrictInt = DEFAULT_MAX_TOKENS
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    top_k: StrictInt = 0
    seed: StrictInt | None = None
    stop: list[str] = Field(default_factory=list)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    stream: bool = False
    dspark: DSparkOptions | None = None
    cache_scope: str | None = None
    """Whose earlier answers this request may draft from, and whose its own answer joins: set by the router from
    the authenticated caller and the tenant (never a request body's field), None for the pool's default scope."""

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise _as_invalid_request(exc) from None

    @model_validator(mode="before")
    @classmethod
    def _refuse_lone_surrogates(cls, data: Any) -> Any:
        check_text(data)
        return data

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_shape(cls, value: Any) -> Any:
        """Checked before the union, so a wrong type names ``tool_choice`` rather than one of its branches."""
        if value is not None and not isinstance(value, (str, dict)):
            raise ValueError(f"tool_choice must be {TOOL_CHOICE_FORMS}; got {value!r}")
        return value

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

    @field_validator("seed")
    @classmethod
    def _check_seed(cls, value: int | None) -> int | None:
        if value is not None and not SEED_MIN <= value <= SEED_MAX:
            raise ValueError(f"seed must be between {SEED_MIN} and {SEED_MAX}, got {value}")
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


def check_text(value: Any, path: str = "") -> None:
    """Refuse a string anywhere in ``value`` that holds a lone surrogate, naming where it is.

    JSON can spell one (``"\\udcff"``) and Python keeps it, but it is not text: the tokenizer, a UTF-8 log line or
    a response body would fail on it far from the request that brought it, as a crash instead of a 400. The walk
    keeps its own stack, so no nesting depth a JSON parser accepts can overflow Python's.
    """
    pending: list[tuple[str, Any]] = [(path, value)]
    while pending:
        where, item = pending.pop()
        if isinstance(item, str):
            _check_encodable(item, where)
        elif isinstance(item, BaseModel):
            pending.append((where, item.model_dump()))
        elif isinstance(item, dict):
            for key, child in item.items():
                _check_encodable(str(key), where)
                pending.append((f"{where}.{key}" if where else str(key), child))
        elif isinstance(item, list | tuple):
            pending.extend((f"{where}.{index}" if where else str(index), child) for index, child in enumerate(item))


def _check_encodable(text: str, where: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        message = f"{where or 'the request'}: holds a lone surrogate at index {exc.start}; text must be valid Unicode"
        raise InvalidRequestError(message, param=where or None) from None


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
    reached_by_offset: list[int] = Field(default_factory=list)
    """Rounds in which draft position k was verified with every earlier position accepted."""
    accepted_by_offset: list[int] = Field(default_factory=list)
    """Rounds in which draft position k was accepted: over ``reached_by_offset``, the conditional acceptance
    the paper's Figure 2 plots; counts rather than a ratio, so a benchmark can pool them over requests."""
    proposed_span_hist: dict[int, int] = Field(default_factory=dict)
    accepted_span_hist: dict[int, int] = Field(default_factory=dict)
    cleared_threshold: dict[int, int] = Field(default_factory=dict)
    fallback_steps: int = 0
    steps: int = 0
    copied_rounds: int = 0
    """Rounds that verified a block copied from the context (n-gram lookup) instead of a drafted one."""
    traffic_rounds: int = 0
    """Rounds that verified a block drafted from the pool's earlier answers (:mod:`backends.dspark.traffic`)."""
    datastore_rounds: int = 0
    """Rounds that verified a block drafted from the target's shipped answers (:mod:`backends.dspark.datastore`)."""
    tree_rounds: int = 0
    """Rounds that verified several looked-up blocks as one token tree (:mod:`backends.dspark.tree`)."""

    @property
    def fallback_rate(self) -> float:
        return self.fallback_steps / self.steps if self.steps else 0.0


class GenerationStats(BaseModel):
    forward_passes: int = 0
    queue_s: float = 0.0
    """Time waiting for a place in the running batch, before decoding started (not in wall_time_s)."""
    wall_time_s: float = 0.0
    time_to_first_token_s: float | None = None
    tokens_per_s: float = 0.0
    forced_tokens: int = 0
    cached_prompt_tokens: int = 0
    """The prompt's first positions copied from the engine's prefix cache instead of run."""
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

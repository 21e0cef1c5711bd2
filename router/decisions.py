"""What the router decided for a request and what it measured: carried on every result and every log record.

Calibration learns from these records, so a decision says not only where a request ran but why (the rule or the
classifier score) and whether it ran somewhere other than the policy's choice (explored, spilled, retried).
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, Field

from backends.types import GenerationRequest, GenerationResult, StreamChunk, Usage


class Sampling(BaseModel):
    """What the serving pool decodes with: the client's values, else the policy's or the pool's defaults, else
    OpenAI's (temperature 1, top_p 1) and the backends' 256 tokens."""

    temperature: float
    top_p: float
    max_tokens: int

    @classmethod
    def of(cls, request: GenerationRequest) -> Sampling:
        return cls(temperature=request.temperature, top_p=request.top_p, max_tokens=request.max_tokens)


class PoolSeen(BaseModel):
    """One pool as the ``time_saved`` objective saw it when it decided, and what it expected there."""

    depth: int = Field(description="requests admitted and not finished")
    running: int = Field(description="requests decoding")
    workers: int
    max_batch: int
    batch: int = Field(description="the batch the request would have joined, itself included")
    speedup: float | None = Field(default=None, description="DSpark pools: the speedup expected at that batch")
    expected_s: float | None = Field(
        description="expected time there: queue wait plus decoding max_tokens (seconds; a relative unit where "
        "neither pool has a profile or tokens_per_s); None: no live worker to decode it"
    )


class Decision(BaseModel):
    pool: str = Field(description="the pool that served (or would serve) the request")
    policy_pool: str = Field(description="the pool the policy chose, before exploring, spilling or falling back")
    rule: str = Field(
        description="the rule that fired, or 'hint', 'classifier', 'time_saved', 'template_probe', 'default'"
    )
    reason: str
    score: float | None = None
    expected_speedup: float | None = Field(
        default=None, description="time_saved: the expected-gain model's solo DSpark speedup for the request"
    )
    load: dict[str, PoolSeen] | None = Field(
        default=None, description="time_saved: the dspark and standard pools as the policy saw them"
    )
    tenant: str | None = None
    overflowed: bool = False
    fell_back: bool = False
    explored: bool = False
    shadow: str | None = Field(
        default=None, description="the pool the request is replayed on once answered, to measure its speedup"
    )
    sampling: Sampling | None = Field(default=None, description="the settings the pool decodes (would decode) with")


class Measured(BaseModel):
    """Seen from the router: latency and time to first token include the queue wait."""

    latency_s: float
    ttft_s: float
    tokens_per_s: float
    queue_s: float = Field(default=0.0, description="time before decoding started: pool queue and batch wait")
    mean_accepted_tokens: float | None = Field(
        default=None, description="tokens committed per forward pass; 1.0 for plain decoding, None when remote"
    )


class RoutedResult(GenerationResult):
    request_id: str
    decision: Decision
    measured: Measured


class RoutedChunk(StreamChunk):
    """A streamed piece with the decision; the last one carries the whole :class:`RoutedResult`."""

    decision: Decision
    result: RoutedResult | None = None


class RouteRecord(BaseModel):
    """One line of the decision log: enough to recompute a score and compare the pools later.

    ``request`` and ``stats`` follow ``classifiers.records.Measurement`` (the chat-completions body; backend
    timings keyed by the pool that ran), so ``calibrate --from-log`` reads the log as it reads measurements.
    """

    ts: float = Field(default_factory=time.time)
    request_id: str
    decision: Decision
    measured: Measured | None = None
    stats: dict[str, dict[str, float | int | None]] = Field(default_factory=dict)
    speedup: float | None = Field(
        default=None,
        description="DSpark over standard time per output token, when a shadow run measured both pools on the request",
    )
    finish_reason: str | None = None
    usage: Usage | None = None
    error: str | None = None
    request: dict[str, Any] | None = None

"""One request inside the batching engine: its decode loop, its output so far, and the chunks its caller reads.

The engine thread pushes committed spans in (``push``); the caller's thread reads chunks out (``read``). The
two meet only at a queue, so a slow consumer never holds up the batch, and a consumer that stops reading
(a closed stream, a client gone) marks the sequence cancelled, which the engine sees at its next step.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

import torch

from backends.constraints import GrammarConstraint, cut_tool_call, parse_tool_calls
from backends.output import OutputTracker
from backends.steps import DecodeLoop, Step
from backends.types import GenerationRequest, GenerationResult, GenerationStats, StreamChunk, Usage


class Sequence:
    def __init__(
        self,
        request: GenerationRequest,
        prompt: list[int],
        tracker: OutputTracker,
        constraint: GrammarConstraint | None,
        generator: torch.Generator | None,
        deltas: bool = True,
    ) -> None:
        self.request = request
        self.deltas = deltas
        self.prompt = prompt
        self.tracker = tracker
        self.constraint = constraint
        self.generator = generator
        self.stats = GenerationStats()
        self.loop: DecodeLoop | None = None
        """Made by the backend in the caller's thread, so a request its backend cannot serve fails there."""
        self.pending: Step | None = None
        """What the loop asked for last and the engine has not answered yet."""
        self.cancelled = threading.Event()
        self.submitted = time.perf_counter()
        self.started: float | None = None
        self._chunks: queue.SimpleQueue[StreamChunk | BaseException] = queue.SimpleQueue()

    @property
    def reserved_tokens(self) -> int:
        """KV cache positions this request may come to hold: what admission counts against the pool's cap."""
        return len(self.prompt) + self.request.max_tokens

    def start(self) -> None:
        """Admitted to the batch: from here on the request's time is decoding time."""
        self.started = time.perf_counter()
        self.stats.queue_s = self.started - self.submitted

    def push(self, span: list[int]) -> bool:
        """Commit a span the loop yielded; True once the output has ended (EOS, stop, length, grammar)."""
        if self.stats.time_to_first_token_s is None:
            self.stats.time_to_first_token_s = time.perf_counter() - self.started
        self.tracker.push(span)
        if self.constraint is not None and self.constraint.is_finished and not self.tracker.finished:
            self.tracker.finish("stop")
        if self.deltas and not self.tracker.finished:
            delta = self.tracker.take_delta()
            if delta:
                self._chunks.put(StreamChunk(delta=delta))
        return self.tracker.finished

    def finish(self) -> None:
        """The last chunk, with the whole result; the loop is closed first so its own statistics are final."""
        if self.loop is not None:
            self.loop.close()
        stats, tracker, request = self.stats, self.tracker, self.request
        stats.wall_time_s = time.perf_counter() - self.started
        stats.constraint_s = self.constraint.elapsed_s if self.constraint is not None else 0.0
        stats.tokens_per_s = len(tracker.token_ids) / stats.wall_time_s if stats.wall_time_s else 0.0
        finish_reason, tool_calls = tracker.finish_reason or "length", None
        if request.tools and request.tool_choice != "none":
            tool_calls = parse_tool_calls(tracker.text, request.tools)
            if tool_calls:
                finish_reason = "tool_calls"
            elif finish_reason == "length":
                tool_calls = cut_tool_call(tracker.text, request.tools)
        result = GenerationResult(
            text=tracker.text,
            token_ids=tracker.token_ids,
            finish_reason=finish_reason,
            usage=Usage(prompt_tokens=len(self.prompt), completion_tokens=len(tracker.token_ids)),
            stats=stats,
            tool_calls=tool_calls,
        )
        self._chunks.put(StreamChunk(delta=tracker.take_delta(), finish_reason=result.finish_reason, result=result))

    def fail(self, error: BaseException) -> None:
        if self.loop is not None:
            self.loop.close()
        self._chunks.put(error)

    def read(self) -> Iterator[StreamChunk]:
        """The chunks, in the caller's thread, up to the one with the result; leaving early cancels."""
        try:
            while True:
                item = self._chunks.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.result is not None:
                    return
        finally:
            self.cancelled.set()

"""What every in-process torch backend shares: request in, decoder spans through the tracker, result out.

A concrete backend only writes its decode loop, ``_decode``: a generator that yields the tokens each forward
pass commits. This class turns it into ``complete``/``stream`` and their async forms, times it, and closes the
generator as soon as the tracker says the completion has ended, so no forward pass is spent past a stop.
"""

from __future__ import annotations

import asyncio
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterator

import torch

from backends.constraints import GrammarConstraint, parse_tool_calls
from backends.loading import LoadedModel, prompt_ids
from backends.output import OutputTracker
from backends.sampling import make_generator
from backends.types import GenerationRequest, GenerationResult, GenerationStats, StreamChunk, Usage


class LocalBackend(ABC):
    name = "local"

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self._lock = threading.Lock()

    @abstractmethod
    def _decode(
        self,
        prompt: list[int],
        request: GenerationRequest,
        generator: torch.Generator | None,
        stats: GenerationStats,
        constraint: GrammarConstraint | None,
    ) -> Iterator[list[int]]:
        """Yield the tokens each forward pass commits (grammar-valid when ``constraint`` is given),
        counting passes in ``stats``."""

    def stream(self, request: GenerationRequest) -> Iterator[StreamChunk]:
        """Grammar and prompt are built first, so a bad request is refused before any forward pass."""
        loaded = self.loaded
        vocab_size = loaded.model.get_output_embeddings().weight.shape[0]
        constraint = GrammarConstraint.from_request(request, loaded.tokenizer, vocab_size, loaded.eos_ids)
        prompt = prompt_ids(loaded, request)
        with self._lock, torch.inference_mode():
            stats = GenerationStats()
            tracker = OutputTracker(loaded.tokenizer, request, loaded.eos_ids)
            generator = make_generator(request, loaded.device)
            started = time.perf_counter()
            steps = self._decode(prompt, request, generator, stats, constraint)
            try:
                for span in steps:
                    if stats.time_to_first_token_s is None:
                        stats.time_to_first_token_s = time.perf_counter() - started
                    tracker.push(span)
                    if constraint is not None and constraint.is_finished and not tracker.finished:
                        tracker.finish("stop")
                    if tracker.finished:
                        break
                    delta = tracker.take_delta()
                    if delta:
                        yield StreamChunk(delta=delta)
            finally:
                steps.close()
            stats.wall_time_s = time.perf_counter() - started
            stats.constraint_s = constraint.elapsed_s if constraint is not None else 0.0
            stats.tokens_per_s = len(tracker.token_ids) / stats.wall_time_s if stats.wall_time_s else 0.0
        tool_calls = (
            parse_tool_calls(tracker.text, request.tools) if request.tools and request.tool_choice != "none" else None
        )
        result = GenerationResult(
            text=tracker.text,
            token_ids=tracker.token_ids,
            finish_reason="tool_calls" if tool_calls else tracker.finish_reason or "length",
            usage=Usage(prompt_tokens=len(prompt), completion_tokens=len(tracker.token_ids)),
            stats=stats,
            tool_calls=tool_calls,
        )
        yield StreamChunk(delta=tracker.take_delta(), finish_reason=result.finish_reason, result=result)

    def complete(self, request: GenerationRequest) -> GenerationResult:
        *_, last = self.stream(request)
        return last.result

    async def acomplete(self, request: GenerationRequest) -> GenerationResult:
        return await asyncio.to_thread(self.complete, request)

    async def astream(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        """Runs the sync stream on a thread and hands chunks over as they come, so the event loop never blocks.
        A consumer that stops early stops the decoding too, instead of leaving it to run on for nobody."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[StreamChunk | BaseException | None] = asyncio.Queue()
        abandoned = threading.Event()

        def produce() -> None:
            try:
                for chunk in self.stream(request):
                    if abandoned.is_set():
                        return
                    loop.call_soon_threadsafe(queue.put_nowait, chunk)
            except BaseException as exc:  # handed to the consumer, raised there
                loop.call_soon_threadsafe(queue.put_nowait, exc)
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, None)

        worker = loop.run_in_executor(None, produce)
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            abandoned.set()
        await worker

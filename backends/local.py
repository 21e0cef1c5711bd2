"""What every in-process torch backend shares: request in, batched decoding, result out.

A concrete backend only writes its decode loop, ``_decode``: the one-request loop as a generator that yields
the forwards it needs and the tokens each one commits (see :mod:`backends.steps`). This class checks the
request, builds its grammar and prompt, and hands it to the backend's :class:`~backends.engine.DecodeEngine`,
which runs every concurrent request's loop in one batch and ends each the moment its output ends, so no
forward pass is spent past a stop. The caller's thread only reads the request's chunks.
"""

from __future__ import annotations

import asyncio
import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterator

import torch

from backends.constraints import GrammarConstraint
from backends.constraints.vocabulary import llg_tokenizer
from backends.engine import BatchLimits, DecodeEngine
from backends.loading import LoadedModel, prompt_ids
from backends.output import OutputTracker
from backends.sampling import make_generator
from backends.sequence import Sequence
from backends.steps import DecodeLoop
from backends.types import GenerationRequest, GenerationResult, GenerationStats, StreamChunk


class LocalBackend(ABC):
    name = "local"

    def __init__(
        self, loaded: LoadedModel, limits: BatchLimits | None = None, state_layers: tuple[int, ...] = ()
    ) -> None:
        """``state_layers``: the hidden-state layers the decode loops read (see :class:`DecodeEngine`)."""
        self.loaded = loaded
        self.engine = DecodeEngine(loaded, limits, state_layers)

    def cache_bytes(self) -> dict[str, int]:
        """What this backend's caches hold in memory, by cache (one of :data:`~backends.types.CACHES`), for the
        pool's metrics."""
        return {"prefix": self.engine.prefix_cache_bytes}

    def prepare_grammars(self) -> None:
        """Build the grammar engine's view of the vocabulary now (once a process and tokenizer; about 0.4 s for
        SmolLM2's 49k tokens), so the first request with a schema, regex or tool does not wait for it."""
        llg_tokenizer(self.loaded.tokenizer, self.vocab_size, self.loaded.eos_ids)

    @property
    def vocab_size(self) -> int:
        """The width of the model's logits (often padded past the tokenizer's ids): what a grammar's masks span."""
        return self.loaded.model.get_output_embeddings().weight.shape[0]

    @abstractmethod
    def _decode(
        self,
        prompt: list[int],
        request: GenerationRequest,
        generator: torch.Generator | None,
        stats: GenerationStats,
        constraint: GrammarConstraint | None,
    ) -> DecodeLoop:
        """The request's decode loop (grammar-valid when ``constraint`` is given), counting passes in ``stats``."""

    def stream(self, request: GenerationRequest, deltas: bool = True) -> Iterator[StreamChunk]:
        """Grammar and prompt are built first, so a bad request is refused before it joins the batch. Without
        ``deltas`` only the final chunk comes: no reader thread is woken at every step for text nobody reads."""
        loaded = self.loaded
        constraint = GrammarConstraint.from_request(request, loaded.tokenizer, self.vocab_size, loaded.eos_ids)
        sequence = Sequence(
            request,
            prompt_ids(loaded, request),
            OutputTracker(loaded.tokenizer, request, loaded.eos_ids),
            constraint,
            make_generator(request, loaded.device),
            deltas=deltas,
        )
        sequence.loop = self._decode(sequence.prompt, request, sequence.generator, sequence.stats, sequence.constraint)
        self.engine.submit(sequence)
        yield from sequence.read()

    def complete(self, request: GenerationRequest) -> GenerationResult:
        *_, last = self.stream(request, deltas=False)
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

"""The one interface every decoding backend offers: the router and the gateway only ever talk to this."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Protocol, runtime_checkable

from backends.types import GenerationRequest, GenerationResult, StreamChunk


@runtime_checkable
class Backend(Protocol):
    name: str

    def complete(self, request: GenerationRequest) -> GenerationResult: ...

    def stream(self, request: GenerationRequest) -> Iterator[StreamChunk]: ...

    async def acomplete(self, request: GenerationRequest) -> GenerationResult: ...

    def astream(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]: ...

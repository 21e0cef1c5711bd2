"""Hand items made in worker threads to one consumer, sync or async, until the work's future is done.

A consumer that stops reading closes its feed; the worker's next ``put`` then raises :class:`StreamClosed`, which
ends the generation instead of decoding for nobody. A worker that goes silent past the timeout ends the
consumer's wait with :class:`PoolTimeoutError`, so no stream ever hangs.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

from router.errors import PoolTimeoutError, StreamClosed

T = TypeVar("T")
_END = object()


class Feed(Generic[T]):
    def __init__(self) -> None:
        self._items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = threading.Event()

    def put(self, item: T) -> None:
        if self._closed.is_set():
            raise StreamClosed("the stream's consumer went away")
        self._items.put(item)

    def drain(self, future: Future[Any], timeout_s: float, source: str) -> Iterator[T]:
        """Items until ``future`` is done, then its exception if it failed."""
        future.add_done_callback(lambda _: self._items.put(_END))
        try:
            while True:
                try:
                    item = self._items.get(timeout=timeout_s)
                except queue.Empty:
                    raise PoolTimeoutError(f"{source} sent nothing for {timeout_s:g}s") from None
                if item is _END:
                    future.result()
                    return
                yield item
        finally:
            self._closed.set()


class AsyncFeed(Generic[T]):
    """The same for an event loop: workers hand items over with ``call_soon_threadsafe``."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._items: asyncio.Queue[Any] = asyncio.Queue()
        self._closed = threading.Event()

    def put(self, item: T) -> None:
        if self._closed.is_set():
            raise StreamClosed("the stream's consumer went away")
        try:
            self._loop.call_soon_threadsafe(self._items.put_nowait, item)
        except RuntimeError:  # the consumer's event loop is closed: nobody will read this
            raise StreamClosed("the stream's event loop is closed") from None

    async def drain(self, future: Future[Any], timeout_s: float, source: str) -> AsyncIterator[T]:
        future.add_done_callback(lambda _: self._loop.call_soon_threadsafe(self._items.put_nowait, _END))
        try:
            while True:
                try:
                    item = await asyncio.wait_for(self._items.get(), timeout_s)
                except asyncio.TimeoutError:  # not yet the builtin TimeoutError on Python 3.10
                    raise PoolTimeoutError(f"{source} sent nothing for {timeout_s:g}s") from None
                if item is _END:
                    future.result()
                    return
                yield item
        finally:
            self._closed.set()

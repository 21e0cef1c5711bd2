"""Stop working for a client the moment it disconnects, instead of when the answer would have been sent.

Once a request's body is read, the next ASGI message uvicorn delivers is ``http.disconnect``: it arrives when the
connection closes, even while the server sends nothing (a queued request, a held-back tool call). So a watcher
waits for that message beside the work, and a disconnect cancels the work; the SDK turns the cancellation into
``Flight.cancel()``, which ends decoding within one step and frees the pool slot.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar, cast

from starlette.types import Receive

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its answer was ready; there is no one left to answer."""


async def _cancel_on_disconnect(receive: Receive, task: asyncio.Task) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    task.cancel()


async def unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """``work``'s result; or, if the client disconnects first, :class:`ClientGone` once ``work`` is cancelled.

    ``work`` runs in the calling task, and a watcher cancels that task on the disconnect: one task per request
    instead of two, since this is on every completion's path. The cancellation it causes is told apart from one
    of the task's own (the server shutting down) by whether the watcher fired.
    """
    task = cast(asyncio.Task, asyncio.current_task())  # an ASGI app always runs in a task
    watcher = asyncio.ensure_future(_cancel_on_disconnect(receive, task))
    try:
        return await work
    except asyncio.CancelledError:
        if not watcher.done() or watcher.cancelled():
            raise
        if hasattr(task, "uncancel"):  # Python 3.11+ counts cancellations; this one is handled here
            task.uncancel()
        raise ClientGone("the client disconnected") from None
    finally:
        watcher.cancel()

"""StreamHandle: the HTTP side's end of one choice the engine generates.

The engine (on the client's event loop) posts events from its own thread; they are queued on the HTTP loop the
handle was made on, so `await next()` there returns them in order.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from corolla.api.stream import StreamEvent


class StreamHandle:
    """The HTTP side's end of one choice: `await next()` returns its events in order, `cancel()` ends it now."""

    def __init__(self, cancel: Callable[[StreamHandle], None], loop: asyncio.AbstractEventLoop):
        self._cancel = cancel  # tells the engine (thread-safe)
        self._loop = loop
        self._events: asyncio.Queue[StreamEvent] = asyncio.Queue()
        self.finished = False  # the last event (finish or error) was taken

    def post(self, event: StreamEvent) -> None:
        """Queue an event for the HTTP side (any thread)."""
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the HTTP loop is closed: nobody is listening
            pass

    async def next(self) -> StreamEvent:
        event = await self._events.get()
        if event.finish_reason is not None or event.error is not None:
            self.finished = True
        return event

    def cancel(self) -> None:
        """End the choice (the client went away): its session is closed, its reservations freed at once."""
        if not self.finished:
            self.finished = True
            self._cancel(self)

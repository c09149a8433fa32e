"""One compute thread per device, fed by a priority queue, awaited from the event loop.

Torch releases the GIL inside kernels, so the event loop keeps serving streams and the DHT while a step runs.
Lower priority numbers run first: inference steps (latency-bound) go before forward passes (throughput-bound).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from typing import Any, Callable, TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")

PRIORITY_INFERENCE = 0
PRIORITY_FORWARD = 1
_STOP = object()


class ComputeWorker:
    def __init__(self, name: str = "corolla-compute"):
        self._queue: queue.PriorityQueue[tuple[int, int, Any]] = queue.PriorityQueue()
        self._counter = itertools.count()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    async def run(self, priority: int, fn: Callable[..., T], *args: Any) -> T:
        """Run fn(*args) on the compute thread; its exception propagates to the awaiting caller."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._queue.put((priority, next(self._counter), (loop, future, fn, args)))
        return await future

    def shutdown(self) -> None:
        self._queue.put((-1, -1, _STOP))
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            _, _, item = self._queue.get()
            if item is _STOP:
                return
            loop, future, fn, args = item
            if future.cancelled():
                continue
            try:
                result = fn(*args)
            except BaseException as e:  # delivered to the awaiting coroutine, which decides
                loop.call_soon_threadsafe(_set_exception, future, e)
            else:
                loop.call_soon_threadsafe(_set_result, future, result)


def _set_result(future: asyncio.Future[Any], result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)

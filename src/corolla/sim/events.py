"""The simulator's clock: a heap of timed events, popped in time order (ties in the order they were pushed)."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any


class EventQueue:
    """`at(time, handler, *args)` schedules handler(*args) at `time` (simulated seconds); `run_until(end)` calls
    them in order, advancing `now`, and stops before the first event past `end`."""

    def __init__(self) -> None:
        self.now = 0.0
        self.events = 0  # handled so far
        self._heap: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = 0

    def at(self, time: float, handler: Callable[..., Any], *args: Any) -> None:
        if time < self.now:
            time = self.now  # an event is never in the past (rounding)
        self._seq += 1
        heapq.heappush(self._heap, (time, self._seq, handler, args))

    def after(self, delay: float, handler: Callable[..., Any], *args: Any) -> None:
        self.at(self.now + max(0.0, delay), handler, *args)

    def run_until(self, end: float) -> None:
        heap = self._heap
        while heap and heap[0][0] <= end:
            time, _, handler, args = heapq.heappop(heap)
            self.now = time
            self.events += 1
            handler(*args)
        self.now = end

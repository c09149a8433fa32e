"""Whether a server's compute is past its peak: admission by compute.

A server's cache says how many sessions it can hold; its compute says how many it can serve at full speed. Past its
most efficient batch (`max_batch`, the scheduler's cap) a server only queues steps: every session it serves slows
down, and every other server on those sessions' routes then holds their caches for fewer tokens in flight. So a
server whose compute is past its peak admits no new session (server.cache.queue.grants, `saturated`): new sessions
wait in its cache queue, up to their timeout, until its compute is back under its peak, and the sessions it serves
keep their speed. Measured by the simulator on a saturated swarm: 0.91 of the capacity bound served instead of 0.88
(docs/benchmarks.md).

Past its peak means: in the last `window` seconds, at least `share` of the time the compute thread ran batches that
were full (`max_batch` tasks) and left steps of the same priority waiting behind them. A busy server whose batches
are not full is not past its peak: a larger batch costs little more than a smaller one, so more sessions add tokens.

The compute thread records each batch (`observe`); the event loop asks (`saturated`). Both under one lock.
"""

from __future__ import annotations

import threading
from collections import deque

WINDOW = 2.0  # seconds of the compute thread's recent history looked at
SHARE = 0.5  # of which at least this share full batches with steps waiting: past the peak


class Saturation:
    def __init__(self, window: float = WINDOW, share: float = SHARE):
        self.window = window
        self.share = share
        self._full: deque[tuple[float, float]] = deque()  # (ended at, seconds) of full batches with steps waiting
        self._lock = threading.Lock()

    def observe(self, ended: float, seconds: float, full: bool) -> None:
        """A batch ran for `seconds` up to `ended` (time.monotonic()); `full`: it held max_batch tasks and left steps
        of the same priority queued."""
        if not full:
            return
        with self._lock:
            self._full.append((ended, seconds))
            self._forget(ended)

    def saturated(self, now: float) -> bool:
        """Past the peak at `now` (module doc)."""
        with self._lock:
            self._forget(now)
            start = now - self.window
            busy = sum(min(seconds, ended - start) for ended, seconds in self._full)
        return busy >= self.share * self.window

    def _forget(self, now: float) -> None:
        while self._full and self._full[0][0] <= now - self.window:
            self._full.popleft()

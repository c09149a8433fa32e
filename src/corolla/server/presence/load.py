"""How busy this server is, as it announces it (ServerInfo.sessions, .queued, .step_seconds) so that clients spread
their sessions (client.swarm.routing prices a block at the larger of its idle compute and `step_seconds`).

`LoadMeter` keeps the recent decode steps' seconds per block, each measured from the moment the step was queued
to its result: a step that waited behind a full batch counts its wait, which is what a new session would see.
It is fed from the compute thread (`observe`) and read on the event loop (`step_seconds`); a deque's appends and
copies are atomic, so neither side locks.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from corolla.server.metrics import step_path

WINDOW_SECONDS = 60.0  # steps older than this no longer count
MAX_SAMPLES = 512  # steps kept at most (the most recent)


class LoadMeter:
    def __init__(self, blocks: Callable[[], int], clock: Callable[[], float] = time.monotonic):
        """`blocks()`: how many blocks this server hosts now (a step's seconds are divided by it)."""
        self.blocks = blocks
        self.clock = clock
        self._samples: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)  # (when, seconds per block)

    def observe(self, fn: Callable[..., Any], batch_size: int, latencies: list[float]) -> None:
        """The compute worker ran `fn` for `batch_size` tasks, each `latencies[i]` seconds after it was queued;
        only decode steps count."""
        if step_path(fn) != "decode" or not latencies:
            return
        now, blocks = self.clock(), max(1, self.blocks())
        for seconds in latencies:
            self._samples.append((now, seconds / blocks))

    def step_seconds(self) -> float:
        """Median seconds per block of the decode steps of the last WINDOW_SECONDS; 0.0 when there were none."""
        horizon = self.clock() - WINDOW_SECONDS
        recent = [seconds for when, seconds in list(self._samples) if when >= horizon]
        return statistics.median(recent) if recent else 0.0

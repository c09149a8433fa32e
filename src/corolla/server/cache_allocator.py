"""Waiting for KV-cache tokens: a FIFO queue in front of CacheBudget, in the server's event loop.

Requests are granted in arrival order, so a large request is not starved by a stream of small ones.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import TYPE_CHECKING

from corolla.server.memory_cache import CacheBudget

if TYPE_CHECKING:
    from corolla.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)


class CacheAllocator:
    def __init__(self, total_tokens: int, metrics: ServerMetrics | None = None):
        self.budget = CacheBudget(total_tokens)
        self.metrics = metrics  # told each reservation's outcome
        self._waiters: deque[tuple[str, int, asyncio.Future[None]]] = deque()

    async def reserve(self, owner: str, tokens: int, timeout: float) -> bool:
        """Wait up to `timeout` seconds for `tokens`; True once reserved, False on timeout or if it can never fit."""
        if tokens > self.budget.total:
            if self.metrics is not None:
                self.metrics.observe_reservation("too_large", 0.0)
            return False
        begin = time.monotonic()
        granted = await self._wait_for(owner, tokens, timeout)
        if self.metrics is not None:
            self.metrics.observe_reservation("granted" if granted else "timeout", time.monotonic() - begin)
        return granted

    async def _wait_for(self, owner: str, tokens: int, timeout: float) -> bool:
        if not self._waiters and self.budget.try_reserve(owner, tokens):
            return True
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (owner, tokens, future)
        self._waiters.append(entry)
        logger.debug("cache.wait owner=%s tokens=%d free=%d", owner, tokens, self.budget.free)
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout)
            return True
        except asyncio.TimeoutError:
            pass
        except asyncio.CancelledError:
            if future.done():  # granted, but the caller went away
                self.release(owner)
            raise
        finally:
            if entry in self._waiters:
                self._waiters.remove(entry)
        if future.done():  # granted at the last moment
            return True
        future.cancel()
        self._grant()  # leaving the head of the queue may let the next waiter in
        return False

    def release(self, owner: str) -> None:
        """Free the owner's tokens and hand them to waiters in arrival order."""
        self.budget.release(owner)
        self._grant()

    def _grant(self) -> None:
        while self._waiters:
            owner, tokens, future = self._waiters[0]
            if future.done():
                self._waiters.popleft()
                continue
            if not self.budget.try_reserve(owner, tokens):
                return
            self._waiters.popleft()
            future.set_result(None)

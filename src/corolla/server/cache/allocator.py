"""Waiting for KV-cache tokens: a first-fit queue with an aging bound in front of CacheBudget, in the server's event
loop. The decisions (what is refused at once, what is granted when) are server.cache.queue's; this class only keeps
the queue and wakes the waiters it grants.

A waiter is looked at again whenever something could let it in: a reservation released, a waiter leaving, a new
request arriving, a protection window ending (the protected request no longer holds the others back), and, while
the server's compute is past its peak (`saturated`: nothing is granted then), every RECHECK seconds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from corolla.server.cache.queue import CacheRequest, grants, peer_limit, refusal, window_end
from corolla.server.cache.budget import CacheBudget

logger = logging.getLogger(__name__)

DEFAULT_PATIENCE = 5.0  # seconds (ServerConfig.cache_queue_patience)
RECHECK = 0.25  # seconds between looks at the queue while the compute is past its peak


class ReservationObserver(Protocol):
    """What is told each reservation's outcome (server.metrics.ServerMetrics)."""

    def observe_reservation(self, result: str, waited: float) -> None:
        """`result`: granted, timeout, refused or too_large; `waited`: seconds it waited."""


class CacheAllocator:
    def __init__(self, total_tokens: int, metrics: ReservationObserver | None = None, patience: float = DEFAULT_PATIENCE,
                 peer_share: float = 1.0, saturated: Callable[[], bool] | None = None):
        """`patience`: seconds a waiting request may be overtaken by later ones that fit; `peer_share`: the fraction
        of the budget one peer may hold at once; `saturated`: whether the server's compute is past its peak now
        (server.compute.saturation; None: never)."""
        self.budget = CacheBudget(total_tokens)
        self.saturated = saturated
        self.metrics = metrics  # told each reservation's outcome
        self.patience = patience
        self.peer_limit = peer_limit(total_tokens, peer_share)
        self._waiters: list[tuple[CacheRequest, asyncio.Future[None]]] = []  # oldest first
        self._granted: dict[str, tuple[float, int]] = {}  # owner -> (when granted, tokens), of reservations held
        self.lapse = float("-inf")  # when the last protection window ended with its request still waiting
        self._window_timer: asyncio.TimerHandle | None = None  # the next window's end: look at the queue again

    def refusal(self, tokens: int) -> str | None:
        """Why a request for `tokens` would be refused at once (cache_queue.refusal), or None if it may wait."""
        return refusal(tokens, self.budget.total, self.peer_limit)

    async def reserve(self, owner: str, tokens: int, timeout: float, peer: str = "") -> bool:
        """Wait up to `timeout` seconds for `tokens` for `owner` (a reservation of `peer`), first fit with an aging
        bound (server.cache.queue); True once reserved, False on timeout, or at once if it could never be granted
        (`refusal`)."""
        problem = self.refusal(tokens)
        if problem is not None:
            logger.debug("cache.refused owner=%s peer=%s: %s", owner, peer, problem)
            if self.metrics is not None:
                self.metrics.observe_reservation("too_large" if tokens > self.budget.total else "refused", 0.0)
            return False
        begin = time.monotonic()
        granted = await self._wait_for(CacheRequest(owner, peer, tokens, begin), timeout)
        if self.metrics is not None:
            self.metrics.observe_reservation("granted" if granted else "timeout", time.monotonic() - begin)
        return granted

    async def _wait_for(self, request: CacheRequest, timeout: float) -> bool:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (request, future)
        self._waiters.append(entry)
        self._grant()
        if future.done():
            return True
        logger.debug("cache.wait owner=%s tokens=%d free=%d", request.owner, request.tokens, self.budget.free)
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout)
            return True
        except asyncio.TimeoutError:
            pass
        except asyncio.CancelledError:
            self._leave(entry)
            if future.done():  # granted, but the caller went away
                self.release(request.owner)
            else:
                future.cancel()
                self._grant()  # a waiter leaving may let those behind it in
            raise
        self._leave(entry)
        if future.done():  # granted at the last moment
            return True
        future.cancel()
        self._grant()
        return False

    def release(self, owner: str) -> None:
        """Free the owner's tokens and hand them to the waiters that fit now."""
        self.budget.release(owner)
        self._granted.pop(owner, None)
        self._grant()

    def _leave(self, entry: tuple[CacheRequest, asyncio.Future[None]]) -> None:
        if entry in self._waiters:
            self._waiters.remove(entry)

    def _grant(self) -> None:
        live = [(request, future) for request, future in self._waiters if not future.done()]
        now = time.monotonic()
        for request, _ in live:  # a window that ended with its request still waiting: no chaining (cache.queue, 1.)
            if window_end(request, self.patience) <= now:
                self.lapse = max(self.lapse, window_end(request, self.patience))
        saturated = bool(live) and self.saturated is not None and self.saturated()
        chosen = set(grants(self.budget.free, self.budget.holdings(), self.peer_limit, [request for request, _ in live],
                            now, self.patience, list(self._granted.values()), self.lapse, saturated))
        for entry in live:
            request, future = entry
            if request.owner in chosen:
                reserved = self.budget.try_reserve(request.owner, request.tokens, request.peer)
                assert reserved, "cache_queue.grants chose a request that does not fit"
                self._granted[request.owner] = (now, request.tokens)
                self._leave(entry)
                future.set_result(None)
        self._schedule_look(now, saturated)

    def _schedule_look(self, now: float, saturated: bool) -> None:
        """Look at the queue again when the next protection window of a waiter ends (it may let others in), or in
        RECHECK seconds while the compute is past its peak and requests wait."""
        waiting = [request for request, future in self._waiters if not future.done()]
        ends = [window_end(request, self.patience) for request in waiting] if self.patience > 0 else []
        ends = [end for end in ends if end > now]
        if saturated and waiting:
            ends.append(now + RECHECK)
        if self._window_timer is not None:
            self._window_timer.cancel()
            self._window_timer = None
        if ends:
            self._window_timer = asyncio.get_running_loop().call_later(min(ends) - now + 1e-3, self._grant)

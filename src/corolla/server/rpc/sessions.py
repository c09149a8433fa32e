"""Open inference sessions of one server: each one's cache reservation, its KV cache and what it holds.

A session reserves the cache tokens its blocks really take when it opens (`BlockStack.cache_tokens`: batch_size x
max_length over every hosted block, less over fewer blocks or with sliding-window rings), waiting in the allocator's
queue (server.cache.queue: first fit, with an aging bound) up to the client's alloc_timeout, capped by the server's;
then it gets a zeroed `SessionKV` over its blocks. Whatever ends the session (a close message, an error, a
disconnect, a timeout, the server shutting down), leaving `SessionTable.open` releases both.

One peer may have at most `max_peer_sessions` sessions open or waiting for cache, past which a new one is refused at
once with SERVER_FULL naming the limit (clients route around a full server, and `corolla api` gives up the sessions
it keeps); what share of the cache one peer may hold is the allocator's (server.cache.queue).

Standby replicas (OpenSession.standby, client.chain.standby) give way first: a primary session that does not fit in
the free cache drops open standbys, the most recently opened first, until it fits (only when dropping them makes it
fit), each told so with SERVER_FULL (`drop_standbys`; its owner opens one elsewhere or goes on without). A standby
never drops anything.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from corolla.protocol.messages import ErrorCode, OpenSession
from corolla.server.compute.block_stack import BlockStack
from corolla.server.cache.allocator import CacheAllocator
from corolla.server.compute.worker import PRIORITY_INFERENCE, ComputeWorker
from corolla.server.cache.kv import SessionKV
from corolla.server.compute.planner import Step
from corolla.server.errors import RequestError

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class ServerSession:
    """One open session: blocks [start, end) for `batch_size` rows of up to `max_length` tokens."""

    id: str
    peer: str
    start: int
    end: int
    batch_size: int
    max_length: int
    adapter: str | None  # LoRA adapter of every step; None: the base model
    cache: SessionKV
    position: int = 0  # tokens the cache holds; a step may start at or before it (a rollback)
    last_step_id: int = 0  # the id of the last step run: a session's steps arrive in order (handler.run_step)
    standby: bool = False  # a standby replica: dropped first when a primary session needs the room
    dropped: bool = False  # it was dropped for a primary (its task is cancelled; the owner is told why)

    @property
    def num_blocks(self) -> int:
        return self.end - self.start

    def advance(self, step: Step) -> None:
        """Record that `step` ran: the cache now holds its tokens and nothing after them."""
        self.position = step.end
        self.last_step_id = max(self.last_step_id, step.step_id)


class SessionTable:
    """The sessions this server holds, each owned by the task serving its stream (`tasks`, for shutdown)."""

    def __init__(self, stack: BlockStack, allocator: CacheAllocator, worker: ComputeWorker, max_alloc_timeout: float,
                 max_peer_sessions: int = 384):
        self.stack = stack
        self.allocator = allocator
        self.worker = worker
        self.max_alloc_timeout = max_alloc_timeout
        self.max_peer_sessions = max_peer_sessions
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.by_peer: Counter[str] = Counter()  # sessions open or waiting for cache, per peer (only peers with some)
        self.standbys: dict[str, tuple[ServerSession, int]] = {}  # open standby sessions -> their tokens, oldest first
        self.standbys_dropped = 0  # standbys dropped so far to make room for primaries

    @asynccontextmanager
    async def open(self, request: OpenSession, peer: str, alive: Callable[[], bool] = lambda: True
                   ) -> AsyncIterator[ServerSession]:
        """Reserve and allocate a checked OpenSession's cache; yields the session, releases everything on exit.

        Raises RequestError(SERVER_FULL) if `peer` has max_peer_sessions sessions here already, if the tokens could
        never be reserved (CacheAllocator.refusal), or if they cannot be reserved within the allocation timeout.
        `alive()` says whether the requester is still there once the tokens are granted: a request whose stream
        ended while it queued gets nothing allocated (ConnectionAbortedError), so a peer cannot make the server
        allocate caches nobody will use."""
        if self.by_peer[peer] >= self.max_peer_sessions:
            raise RequestError(ErrorCode.SERVER_FULL, f"server full for your peer: per-peer limit of "
                                                      f"{self.max_peer_sessions} sessions open here reached")
        self.by_peer[peer] += 1
        try:
            async with self._open(request, peer, alive) as session:
                yield session
        finally:
            self.by_peer[peer] -= 1
            if not self.by_peer[peer]:
                del self.by_peer[peer]

    @asynccontextmanager
    async def _open(self, request: OpenSession, peer: str, alive: Callable[[], bool]) -> AsyncIterator[ServerSession]:
        session_id = uuid.uuid4().hex
        tokens = self.stack.cache_tokens(
            request.batch_size, request.max_length, request.blocks.start, request.blocks.end
        )
        timeout = min(request.alloc_timeout, self.max_alloc_timeout)
        problem = self.allocator.refusal(tokens)
        if problem is not None:
            raise RequestError(ErrorCode.SERVER_FULL, f"server full: {problem}")
        if not request.standby:
            await self.drop_standbys(tokens)
        if not await self.allocator.reserve(session_id, tokens, timeout, peer):
            budget = self.allocator.budget
            raise RequestError(
                ErrorCode.SERVER_FULL,
                f"server full: could not reserve {tokens} cache tokens within {timeout:.1f}s "
                f"(free {budget.free} of {budget.total})",
            )
        task = asyncio.current_task()
        if task is not None:
            self.tasks[session_id] = task
        try:
            if not alive():
                raise ConnectionAbortedError("the requester left while its session queued for cache")
            blocks = request.blocks
            logger.debug(
                "session.open id=%s peer=%s blocks=%s max_length=%d batch=%d",
                session_id,
                peer,
                blocks,
                request.max_length,
                request.batch_size,
            )
            cache = await self.worker.run(
                PRIORITY_INFERENCE,
                self.stack.allocate_cache,
                request.batch_size,
                request.max_length,
                blocks.start,
                blocks.end,
            )
            session = ServerSession(session_id, peer, blocks.start, blocks.end, request.batch_size,
                                    request.max_length, request.active_adapter, cache, standby=request.standby)
            if request.standby:
                self.standbys[session_id] = (session, tokens)
            yield session
        finally:
            self.standbys.pop(session_id, None)
            self.tasks.pop(session_id, None)
            self.allocator.release(session_id)
            logger.debug("session.close id=%s free_tokens=%d", session_id, self.allocator.budget.free)

    async def drop_standbys(self, tokens: int, wait: float = 2.0) -> int:
        """Make room for a primary session of `tokens` by dropping open standbys, the most recently opened first, when
        the free cache is short and dropping them makes it fit; waits up to `wait` seconds for their caches to be
        released. Returns how many were dropped."""
        free = self.allocator.budget.free
        if tokens <= free or tokens > free + sum(held for _, held in self.standbys.values()):
            return 0
        chosen: list[asyncio.Task[None]] = []
        for session_id, (session, held) in reversed(list(self.standbys.items())):
            if free >= tokens:
                break
            task = self.tasks.get(session_id)
            if task is None or task.done():
                continue
            session.dropped = True
            task.cancel()
            chosen.append(task)
            free += held
        if chosen:
            self.standbys_dropped += len(chosen)
            logger.info("dropping %d standby session(s) to make room for a primary of %d cache tokens", len(chosen),
                        tokens)
            await asyncio.wait(chosen, timeout=wait)
        return len(chosen)

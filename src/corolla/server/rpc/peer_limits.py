"""Per-peer limits of one server: what a single peer id may hold of it at once (ServerConfig.max_peer_*).

    streams   every stream of any RPC, from the moment it is accepted (before authorization, before anything is read)
              until its handler and linger end; over `max_streams`: refused at once with PEER_LIMIT, not lingered on
    passes    rpc_forward / rpc_backward calls read and run at once; further calls of that peer wait their turn
              unread (a fair share of the compute queue and of the memory their frames take), for `wait` at most
    probes    one bandwidth probe per peer at a time (a second waits PROBE_SLOT_WAIT for the first), `max_probes`
              over all peers; more: PEER_LIMIT

A peer over a limit gets the error on that stream only; its other streams, and every other peer, go on. Each
counter only ever holds peers with something open, so peers that come and go leave nothing behind.

Elsewhere: a peer's sessions (open or waiting for cache) are counted by server.rpc.sessions, its share of the KV cache
by the cache allocator (server.cache.queue), the sizes of its calls by server.rpc.validation.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass

from corolla.protocol.framing import abort_stream
from corolla.protocol.messages import ErrorCode, ErrorReply
from corolla.server.errors import RequestError

logger = logging.getLogger(__name__)

REFUSAL_WRITE_TIMEOUT = 2.0  # seconds a refused stream's error may take to write before the stream is dropped
PROBE_SLOT_WAIT = 1.0  # seconds a peer's probe waits for its previous one to end (it may come just before that)
REFUSAL_LINGER = 1.0  # seconds a refused stream waits for its peer to close it (so the error is not lost), at most


def over(count: int, limit: int) -> bool:
    """Whether taking one more of something a peer holds `count` of passes `limit`."""
    return count + 1 > limit


@dataclass
class _Slots:
    """The slots of one peer: a semaphore, how many calls hold one, and how many hold or wait for one."""

    semaphore: asyncio.Semaphore
    held: int = 0
    users: int = 0


class PeerLimits:
    """The counters of one server's per-peer limits (see the module doc)."""

    def __init__(self, max_streams: int, max_passes: int, max_probes: int):
        self.max_streams = max_streams
        self.max_passes = max_passes
        self.max_probes = max_probes
        self.streams: Counter[str] = Counter()
        self.refusing: Counter[str] = Counter()  # refused streams still being answered, per peer (max_streams at most)
        self.probes: set[str] = set()
        self._passes: dict[str, _Slots] = {}
        self._probe_slots: dict[str, _Slots] = {}

    # ------------------------------------------------------------------ streams
    def guard(self, on_stream: Callable[..., Awaitable[None]], verb: str, reply_with: Callable[..., Awaitable[None]],
              observe: Callable[[str, str], None] | None = None) -> Callable[..., Awaitable[None]]:
        """Wrap a stream handler `on_stream(stream_info, reader, writer)` so that each peer has at most `max_streams`
        streams in it at once: one more is answered with a PEER_LIMIT error (written by `reply_with`, and told to
        observe(verb, code), e.g. ServerMetrics.observe_error) and closed within REFUSAL_LINGER; while `max_streams`
        of its refusals are still being answered, dropped unanswered."""

        async def counted(stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            peer = stream_info.peer_id.to_base58()
            if over(self.streams[peer], self.max_streams):
                if over(self.refusing[peer], self.max_streams):
                    abort_stream(writer)
                    return
                logger.info("stream refused peer=%s verb=%s: %d streams open", peer, verb, self.streams[peer])
                if observe is not None:
                    observe(verb, ErrorCode.PEER_LIMIT.value)
                self.refusing[peer] += 1
                try:
                    await _refuse(
                        reader,
                        writer,
                        reply_with,
                        f"per-peer limit: your peer has {self.streams[peer]} "
                        f"streams open here, the most this server allows one peer",
                    )
                finally:
                    _decrement(self.refusing, peer)
                return
            self.streams[peer] += 1
            try:
                await on_stream(stream_info, reader, writer)
            finally:
                _decrement(self.streams, peer)

        return counted

    # ------------------------------------------------------------------ forward / backward passes
    def pass_slot(self, peer: str, wait: float) -> AbstractAsyncContextManager[None]:
        """Hold one of `peer`'s `max_passes` pass slots, waiting for one in arrival order; RequestError(TIMEOUT) if
        none frees up within `wait` seconds."""
        return _slot(
            self._passes,
            peer,
            self.max_passes,
            wait,
            lambda: RequestError(
                ErrorCode.TIMEOUT,
                f"per-peer limit: your peer's {self.max_passes} forward/backward calls in flight here "
                f"did not finish within {wait:.0f}s",
            ),
        )

    def passes_in_flight(self, peer: str) -> int:
        """Calls of `peer` holding a pass slot now (those waiting for one not counted)."""
        slots = self._passes.get(peer)
        return 0 if slots is None else slots.held

    # ------------------------------------------------------------------ probes
    @asynccontextmanager
    async def probe(self, peer: str) -> AsyncIterator[None]:
        """Hold `peer`'s one probe (waiting PROBE_SLOT_WAIT at most for its previous one to end); RequestError
        (PEER_LIMIT) if it still has one running, or if `max_probes` run already."""
        async with _slot(
            self._probe_slots,
            peer,
            1,
            PROBE_SLOT_WAIT,
            lambda: RequestError(
                ErrorCode.PEER_LIMIT,
                "per-peer limit: your peer has a bandwidth probe running here already (one at a time)",
            ),
        ):
            if over(len(self.probes), self.max_probes):
                raise RequestError(
                    ErrorCode.PEER_LIMIT,
                    f"this server answers {self.max_probes} bandwidth probes at once; try again later",
                )
            self.probes.add(peer)
            try:
                yield
            finally:
                self.probes.discard(peer)


@asynccontextmanager
async def _slot(
    table: dict[str, _Slots], peer: str, capacity: int, wait: float, refusal: Callable[[], RequestError]
) -> AsyncIterator[None]:
    """Hold one of `peer`'s `capacity` slots in `table`, waiting `wait` seconds at most (in arrival order), else raise
    refusal(). A peer's entry lives while some call holds or waits for one of its slots."""
    slots = table.get(peer)
    if slots is None:
        slots = table[peer] = _Slots(asyncio.Semaphore(capacity))
    slots.users += 1
    try:
        try:
            async with asyncio.timeout(wait):
                await slots.semaphore.acquire()
        except TimeoutError:
            raise refusal() from None
        slots.held += 1
        try:
            yield
        finally:
            slots.held -= 1
            slots.semaphore.release()
    finally:
        slots.users -= 1
        if not slots.users:
            del table[peer]


def _decrement(counter: Counter[str], key: str) -> None:
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]


async def _refuse(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, reply_with: Callable[..., Awaitable[None]], message: str
) -> None:
    """Answer a stream refused before its handler with PEER_LIMIT, wait a moment for its peer to close it (closing
    first can lose the answer: see handler._await_peer_close), and drop it."""
    try:
        await asyncio.wait_for(
            reply_with(writer, ErrorReply(code=ErrorCode.PEER_LIMIT, message=message)), REFUSAL_WRITE_TIMEOUT
        )
        await asyncio.wait_for(_drain(reader), REFUSAL_LINGER)
    except (ConnectionError, asyncio.TimeoutError, RuntimeError, OSError):
        pass
    abort_stream(writer)


async def _drain(reader: asyncio.StreamReader) -> None:
    while await reader.read(1 << 16):
        pass

"""A step whose answer is overdue: is its server still there?

A server that crashes refuses or closes its streams, and the client fails over at once. A server whose host is cut
off the network (a partition, a pulled cable, a NAT that dropped the mapping) says nothing at all: its streams stay
open and silent, and a step waiting for its answer would wait the whole `request_timeout` (60 s) before the client
routes around it. So a step's wait for one server's answer is watched: once the answer is overdue (STALL_STEPS times
the session's median step, and at least STALL_FLOOR seconds), the server is asked rpc_info on a fresh stream, with
the time a stream to it may take to open (SequenceManager.open_timeout: 20 of its round trips, at least 2 s). A server
that answers is alive, only busy (a long prefill, a queue): the wait goes on, checked again each overdue period. One
that does not is PeerUnreachable for that span: the session fails over as for a crash, and the server is skipped for
`unreachable_ban` (its ban lifted once it answers a ping again), not retried after a short backoff. The same watch
covers a session's opening (`SpanSession.open`): a stream to a cut-off host can open at once over the connection
p2pd already holds, and the OpenSession's answer then never comes; a server queueing the opening for cache answers
the ping.

The answer's own wait is never cut short by the watch while the server answers pings; what a wait costs at most is
unchanged (`request_timeout`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, TypeVar

from corolla.dht.info import ask_info
from corolla.protocol.errors import PeerUnavailable, PeerUnreachable

if TYPE_CHECKING:
    from corolla.client.swarm.sequence_manager import SequenceManager

logger = logging.getLogger(__name__)

T = TypeVar("T")
STALL_FLOOR = 2.0  # seconds an answer may take before its server is checked, at least
STALL_STEPS = 10.0  # ...and at least this many times the session's median step


def overdue_after(step_latency: float | None) -> float:
    """Seconds after which a step's answer is overdue, given the session's median step (None before any)."""
    return max(STALL_FLOOR, STALL_STEPS * (step_latency or 0.0))


async def watched(answer: Awaitable[T], manager: SequenceManager, peer_id: str, overdue: float) -> T:
    """`answer` (a wait for `peer_id`'s answer to a step), checking the server each `overdue` seconds it takes: raises
    PeerUnreachable once the server answers no rpc_info (module docstring); otherwise whatever `answer` gives."""
    task = asyncio.ensure_future(answer)
    begin = time.perf_counter()
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=overdue)
            if done:
                return task.result()
            check = manager.open_timeout(peer_id)
            try:
                await ask_info(manager.node.p2p, peer_id, check)
            except PeerUnavailable as e:
                if task.done():
                    return task.result()
                waited = time.perf_counter() - begin
                logger.warning("server %s went silent: no answer for %.1fs, nor to a ping within %.1fs", peer_id,
                               waited, check)
                raise PeerUnreachable(f"server {peer_id} went silent: no answer for {waited:.1f}s, nor to a ping "
                                      f"within {check:.1f}s ({e})") from e
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

"""Is each server alive? One rpc_info call per server, timed from the monitor.

A DHT record outlives its server until it expires (90 s by default), so a record alone cannot tell a dead server
from a live one. Asking the server itself can: a server killed a moment ago fails this call at once (its
connection is refused) or within `timeout` (its host vanished), so it shows as gone at the next refresh.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Iterable

from hivemind.p2p import P2P

from corolla.client.swarm.server_info import request_info
from corolla.protocol.errors import PeerUnavailable, RemoteError
from corolla.protocol.messages import InfoReply

logger = logging.getLogger(__name__)

RELAY_MARKER = "/p2p-circuit"  # in the multiaddr of a connection relayed by a third peer


@dataclass(frozen=True)
class Liveness:
    reachable: bool
    rtt: float | None = None  # seconds of the rpc_info round trip (stream open included)
    reply: InfoReply | None = None
    relay: bool | None = None  # None: unknown (not reachable, or no open connection listed)
    error: str | None = None


async def ping_servers(p2p: P2P, peer_ids: Iterable[str], timeout: float, concurrency: int = 32) -> dict[str, Liveness]:
    """rpc_info to every peer at once (at most `concurrency` in flight), each bounded by `timeout` seconds.

    Never raises for a peer's failure: that peer is reported unreachable with the error's text.
    """
    peers = sorted(set(peer_ids))
    limit = asyncio.Semaphore(concurrency)

    async def ping(peer: str) -> Liveness:
        async with limit:
            begin = time.perf_counter()
            try:
                reply = await asyncio.wait_for(request_info(p2p, peer, timeout), timeout)
            except asyncio.TimeoutError:
                return Liveness(False, error=f"no answer within {timeout:.1f}s")
            except (PeerUnavailable, RemoteError, ValueError) as e:  # ValueError: a malformed peer id in a record
                return Liveness(False, error=str(e))
            return Liveness(True, rtt=time.perf_counter() - begin, reply=reply)

    results = dict(zip(peers, await asyncio.gather(*(ping(p) for p in peers))))
    relayed = await _relayed_peers(p2p)
    return {
        peer: Liveness(True, live.rtt, live.reply, relayed.get(peer), None) if live.reachable else live
        for peer, live in results.items()
    }


async def _relayed_peers(p2p: P2P) -> dict[str, bool]:
    """For each peer p2pd holds a connection to: True when every connection to it goes through a relay."""
    try:
        infos = await p2p.list_peers()
    except Exception as e:  # p2pd answers oddly while shutting down; reachability is then unknown
        logger.debug("list_peers failed: %r", e)
        return {}
    relayed: dict[str, bool] = {}
    for info in infos:
        peer = info.peer_id.to_base58()
        via_relay = all(RELAY_MARKER in str(addr) for addr in info.addrs) if info.addrs else False
        relayed[peer] = relayed.get(peer, True) and via_relay
    return relayed

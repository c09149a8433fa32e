"""Is each server alive? One rpc_info call per server, timed from the monitor.

A DHT record outlives its server until it expires (90 s by default), so a record alone cannot tell a dead server
from a live one. Asking the server itself can: a server killed a moment ago fails this call at once (its
connection is refused) or within `timeout` (its host vanished), so it shows as gone at the next refresh.

On a real network a vanished host does not refuse: its ping just never answers. Waiting out `timeout` for it would
make every look after a crash (or a partition) as slow as the timeout, so a ping still out once at least half of the
servers have answered is given up when it has waited SETTLE_FACTOR times their median round trip, and at least
SETTLE_FLOOR seconds: the others' answers say how long an answer takes from here now (a loaded machine or a slow
link lengthens all of them alike).
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from hivemind.p2p import P2P

from corolla.client.swarm.server_info import request_info
from corolla.dht.node import dial
from corolla.protocol.errors import PeerUnavailable, RemoteError
from corolla.protocol.messages import InfoReply

logger = logging.getLogger(__name__)

RELAY_MARKER = "/p2p-circuit"  # in the multiaddr of a connection relayed by a third peer
SETTLE_FACTOR = 5.0  # a ping still out after this many times the answered ones' median round trip is given up...
SETTLE_FLOOR = 1.0  # ...once at least half have answered, and never before this many seconds
SETTLE_TICK = 0.05  # seconds between checks for such pings


@dataclass(frozen=True)
class Liveness:
    reachable: bool
    rtt: float | None = None  # seconds of the rpc_info round trip (stream open included)
    reply: InfoReply | None = None
    relay: bool | None = None  # None: unknown (not reachable, or no open connection listed)
    error: str | None = None


async def ping_servers(p2p: P2P, peer_ids: Iterable[str], timeout: float, concurrency: int = 32,
                       settle: bool = True, maddrs: Mapping[str, Sequence[str]] | None = None) -> dict[str, Liveness]:
    """rpc_info to every peer at once (at most `concurrency` in flight), each bounded by `timeout` seconds, and with
    `settle` given up earlier once the others have answered (see the module docstring). A peer with `maddrs` (what
    its record announces) is dialed there first, within the same time: a server behind a NAT is reachable only
    through the relays its record names, which nothing else would tell p2pd.

    Never raises for a peer's failure: that peer is reported unreachable with the error's text.
    """
    peers = sorted(set(peer_ids))
    limit = asyncio.Semaphore(concurrency)
    running: dict[str, float] = {}  # peer -> when its ping started (time.perf_counter())
    answered: list[float] = []  # round trips of the pings answered so far

    async def ping(peer: str) -> Liveness:
        async with limit:
            begin = running[peer] = time.perf_counter()
            try:
                reply = await asyncio.wait_for(_dial_and_ask(p2p, peer, (maddrs or {}).get(peer, ()), timeout), timeout)
            except asyncio.TimeoutError:
                return Liveness(False, error=f"no answer within {timeout:.1f}s")
            except (PeerUnavailable, RemoteError, ValueError) as e:  # ValueError: a malformed peer id in a record
                return Liveness(False, error=str(e))
            finally:
                running.pop(peer, None)
            answered.append(time.perf_counter() - begin)
            return Liveness(True, rtt=answered[-1], reply=reply)

    tasks = {peer: asyncio.ensure_future(ping(peer)) for peer in peers}
    given_up: dict[str, str] = {}
    watcher = asyncio.ensure_future(_give_up_laggards(tasks, running, answered, given_up)) if settle else None
    try:
        outcomes = await asyncio.gather(*tasks.values(), return_exceptions=True)
    finally:
        if watcher is not None:
            watcher.cancel()
    results: dict[str, Liveness] = {}
    for peer, outcome in zip(tasks, outcomes):
        if isinstance(outcome, asyncio.CancelledError) and peer in given_up:
            results[peer] = Liveness(False, error=given_up[peer])
        elif isinstance(outcome, BaseException):
            raise outcome
        else:
            results[peer] = outcome
    relayed = await _relayed_peers(p2p)
    return {
        peer: Liveness(True, live.rtt, live.reply, relayed.get(peer), None) if live.reachable else live
        for peer, live in results.items()
    }


async def _dial_and_ask(p2p: P2P, peer: str, maddrs: Sequence[str], timeout: float) -> InfoReply:
    if maddrs:
        await dial(p2p, peer, maddrs, timeout)  # a no-op when connected; a failure shows in the request that follows
    return await request_info(p2p, peer, timeout)


async def _give_up_laggards(tasks: dict[str, asyncio.Future], running: dict[str, float], answered: list[float],
                            given_up: dict[str, str]) -> None:
    """Cancel each ping that has waited past the settle limit (module docstring), noting why in `given_up`."""
    while True:
        await asyncio.sleep(SETTLE_TICK)
        if not answered or 2 * len(answered) < len(tasks):
            continue
        median = statistics.median(answered)
        wait = max(SETTLE_FLOOR, SETTLE_FACTOR * median)
        now = time.perf_counter()
        for peer, began in list(running.items()):
            if now - began > wait and peer not in given_up:
                given_up[peer] = (f"no answer within {now - began:.1f}s, while {len(answered)} of {len(tasks)} "
                                  f"servers answered (median {median * 1000:.0f} ms)")
                tasks[peer].cancel()


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

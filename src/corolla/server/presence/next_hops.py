"""Round trips from this server to its likely next hops, announced as ServerInfo.next_pings for push routing.

In push mode a server sends its output straight to the server after it on the client's route, so clients price a
route with server-to-server latencies (client.swarm.routing). Only this server can measure those: every `period`
seconds it reads who holds block `end_block` (the first block after its own range) from the DHT, pings up to
`max_peers` of them with the ping clients use (dht.ping: one rpc_info exchange, the same smoothing), and keeps
the smoothed round trips of the ones that answered. The servers whose range *starts* at `end_block` come first:
they take a pushed step's whole next span; then those whose range only covers it, by peer id.

Cheap and bounded: one DHT read of one key and at most `max_peers` concurrent pings per period, each limited to
`ping_timeout` (after a dial of at most `connect_timeout`), the whole round to `round_timeout`. It runs as its
own task, and the announcer only reads `announced()`, a plain dict: a slow or failing peer delays nothing but
its own entry. A peer that fails its ping, or is no longer a next hop, is dropped from the record (routes then
price that hop through the client).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Mapping

from corolla.dht import SwarmNode, fetch_block_servers
from corolla.dht.ping import ping, smooth
from corolla.protocol.errors import PeerUnavailable
from corolla.protocol.messages import MAX_NEXT_PINGS, MAX_PING_SECONDS, ServerInfo, ServerState

logger = logging.getLogger(__name__)

MAX_NEXT_HOPS = 8  # next-hop servers measured (and announced) at most; <= MAX_NEXT_PINGS
PING_TIMEOUT = 2.0  # seconds one ping may take
CONNECT_TIMEOUT = 5.0  # seconds dialing a next hop at its announced addresses may take
ROUND_TIMEOUT = 15.0  # seconds one whole measuring round (DHT read and pings) may take


def next_hop_candidates(servers: Mapping[str, ServerInfo], me: str, end_block: int,
                        max_peers: int = MAX_NEXT_HOPS) -> list[str]:
    """Peers a step pushed on from a server whose range ends at `end_block` would likely reach, best first.

    `servers` maps peer id -> record of the servers announcing block `end_block`. ONLINE ones other than `me`
    whose range holds `end_block` qualify; those starting exactly there first, then by peer id; at most `max_peers`.
    """
    eligible = [peer for peer, info in servers.items()
                if peer != me and info.state == ServerState.ONLINE and info.start_block <= end_block < info.end_block]
    eligible.sort(key=lambda peer: (servers[peer].start_block != end_block, peer))
    return eligible[:max_peers]


class NextHops:
    """The smoothed round trips (seconds) from this server to its next hops; see the module docstring."""

    def __init__(self, node: SwarmNode, prefix: str, num_blocks: int, *, max_peers: int = MAX_NEXT_HOPS,
                 ping_timeout: float = PING_TIMEOUT, connect_timeout: float = CONNECT_TIMEOUT,
                 round_timeout: float = ROUND_TIMEOUT):
        if not 0 < max_peers <= MAX_NEXT_PINGS:
            raise ValueError(f"max_peers must be in [1, {MAX_NEXT_PINGS}], got {max_peers}")
        self.node = node
        self.prefix = prefix
        self.num_blocks = num_blocks
        self.max_peers = max_peers
        self.ping_timeout = ping_timeout
        self.connect_timeout = connect_timeout
        self.round_timeout = round_timeout
        self.pings: dict[str, float] = {}  # peer id -> smoothed round trip, seconds
        self.codecs: dict[str, tuple[str, ...]] = {}  # peer id -> the codecs its record names (next block's servers)

    def announced(self) -> dict[str, float]:
        """What this server announces as ServerInfo.next_pings: a copy, within the record's bounds."""
        return {peer: min(rtt, MAX_PING_SECONDS) for peer, rtt in list(self.pings.items())[:MAX_NEXT_PINGS]
                if math.isfinite(rtt) and rtt >= 0}

    def codecs_of(self, peer: str) -> tuple[str, ...]:
        """The codecs `peer` announced at the last round, if it holds the block after ours (else only "none")."""
        return self.codecs.get(peer, ("none",))

    async def refresh(self, end_block: int) -> None:
        """One measuring round for a server whose range ends at `end_block`; never raises for a failing peer.

        Raises asyncio.TimeoutError when the round (DHT read included) exceeds `round_timeout`; what was measured
        before that is kept."""
        await asyncio.wait_for(self._refresh(end_block), self.round_timeout)

    async def _refresh(self, end_block: int) -> None:
        if end_block >= self.num_blocks:  # the last blocks of the model: a pushed step ends here
            self.pings.clear()
            self.codecs = {}
            return
        servers = (await fetch_block_servers(self.node.dht, self.prefix, [end_block]))[0]
        self.codecs = {peer: info.codecs for peer, info in servers.items()}
        peers = next_hop_candidates(servers, self.node.peer_id, end_block, self.max_peers)
        samples = await asyncio.gather(*(self._sample(peer, servers[peer].maddrs) for peer in peers))
        self.pings = {peer: smooth(self.pings.get(peer), sample)
                      for peer, sample in zip(peers, samples) if sample is not None}
        logger.debug("next_hops.measured end_block=%d pings=%s", end_block,
                     {p: round(r * 1e3, 2) for p, r in self.pings.items()})

    async def _sample(self, peer: str, maddrs: tuple[str, ...]) -> float | None:
        try:
            return await ping(self.node, peer, maddrs, connect_timeout=self.connect_timeout, timeout=self.ping_timeout)
        except PeerUnavailable as e:
            logger.debug("next_hops.ping_failed peer=%s error=%s", peer, e)
            return None

    async def run(self, period: float, end_block: Callable[[], int | None],
                  on_change: Callable[[], None] | None = None) -> None:
        """Measure now, then every `period` seconds, until cancelled. `end_block()` gives the current end of this
        server's range (None: not serving, skip the round); `on_change` is called when the set of measured peers
        changed (e.g. to announce at once)."""
        while True:
            end = end_block()
            before = set(self.pings)
            if end is not None:
                try:
                    await self.refresh(end)
                except Exception as e:  # the DHT may be unreachable, or the round too slow: try again next period
                    logger.debug("next_hops.round_failed error=%r", e)
            if on_change is not None and set(self.pings) != before:
                on_change()
            await asyncio.sleep(period)

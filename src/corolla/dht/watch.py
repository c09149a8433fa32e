"""Staying in the swarm through network outages: re-bootstrap from the initial peers and every peer seen.

hivemind's DHT node drops a peer from its routing table when a request to it fails, and bans it for a growing
while (its "blacklist"). After an outage long enough to fail a few requests, a node therefore knows nobody and
would stay alone even once the network is back: Petals servers vanished from their swarm this way (petals#254).

`SwarmWatch.run` checks every `period` seconds:
- the initial peers: one that is missing from the routing table is pinged again (a bootstrap peer that restarted
  learns about us this way, and new peers can join through it again);
- the routing table: when it is empty and the node has initial peers, it rejoins: forget the bans, dial the
  initial peers at their addresses, ping them and every peer seen before, and look up its own neighbourhood.
  Failed attempts are retried with exponential backoff from `period` up to `max_backoff` seconds; every attempt
  and its outcome is logged. (A node without initial peers started the swarm: it waits for the others, who ping
  their initial peers.)
`on_rejoined` callbacks run after a successful rejoin (a server re-announces its blocks at once).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Awaitable, Callable

from hivemind.p2p import PeerID

if TYPE_CHECKING:
    from corolla.dht.node import SwarmNode

logger = logging.getLogger(__name__)

MAX_SEEN_PEERS = 256  # most recently seen peers kept for re-bootstrapping


def next_backoff(current: float, period: float, max_backoff: float) -> float:
    """The wait after another failed rejoin: doubles from `period`, capped at `max_backoff` (seconds)."""
    return min(max_backoff, max(period, current * 2))


class SwarmWatch:
    def __init__(self, node: SwarmNode, period: float = 5.0, max_backoff: float = 30.0):
        if period <= 0 or max_backoff < period:
            raise ValueError(f"need 0 < period <= max_backoff, got {period} and {max_backoff}")
        self.node = node
        self.period = period  # seconds between checks
        self.max_backoff = max_backoff  # longest wait between failed rejoin attempts, seconds
        self.seen: dict[str, float] = {}  # peer id -> when last seen in the routing table (monotonic seconds)
        self.on_rejoined: list[Callable[[], Awaitable[None]]] = []
        self.rejoins = 0  # successful rejoins so far
        self._isolated_since: float | None = None
        self._failed_attempts = 0

    def routing_peers(self) -> list[str]:
        """Peer ids in the DHT routing table now."""
        return [peer.to_base58() for peer in list(self.node.dht.protocol.routing_table.peer_id_to_uid)]

    async def run(self) -> None:
        """Check forever (until cancelled); never raises otherwise."""
        backoff = self.period
        while True:
            await asyncio.sleep(backoff if self._isolated_since is not None else self.period)
            try:
                if await self.check():
                    backoff = self.period
                else:
                    backoff = next_backoff(backoff, self.period, self.max_backoff)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not end the watch: log it and check again later
                logger.exception("swarm watch check failed")

    async def check(self) -> bool:
        """One check; returns False only when the node is cut off and rejoining failed."""
        peers = self.routing_peers()
        now = time.monotonic()
        for peer in peers:
            self.seen[peer] = now
        if len(self.seen) > MAX_SEEN_PEERS:
            for peer in sorted(self.seen, key=self.seen.get)[: len(self.seen) - MAX_SEEN_PEERS]:
                del self.seen[peer]
        if peers:
            if self._isolated_since is not None:  # back through another path (an announce, a peer that dialed us)
                await self._rejoined(len(peers))
            await self._ping_missing_initial_peers(set(peers))
            return True
        if not self.node.initial_peers:
            return True  # a first peer of a swarm: the others come back to it (they ping their initial peers)
        if self._isolated_since is None:
            self._isolated_since = now
            logger.warning("lost contact with the swarm (no DHT peer answers); rejoining through %d initial and %d "
                           "seen peer(s)", len(self.node.initial_peers), len(self.seen))
        return await self.rejoin()

    async def rejoin(self) -> bool:
        """Re-bootstrap now; True when some peer answered."""
        dht = self.node.dht
        dht.blacklist.clear()  # bans earned during the outage would hide the peers for minutes after it
        await asyncio.gather(*(self.node.connect(p, [m]) for m, p in self.node.initial_peer_ids.items()))
        targets = {PeerID.from_base58(p) for p in [*self.seen, *self.node.initial_peer_ids.values()]}
        answers = await asyncio.gather(*(dht.protocol.call_ping(peer) for peer in targets), return_exceptions=True)
        answered = sum(1 for a in answers if a is not None and not isinstance(a, BaseException))
        if not answered:
            self._failed_attempts += 1
            log = (
                logger.info if self._failed_attempts & (self._failed_attempts - 1) == 0 else logger.debug
            )  # 1, 2, 4...
            log("rejoin attempt %d: none of %d peer(s) answered; retrying", self._failed_attempts, len(targets))
            return False
        await dht.find_nearest_nodes([dht.node_id])
        await self._rejoined(answered)
        return True

    async def _rejoined(self, answered: int) -> None:
        """The node is in contact again: log it and run the on_rejoined callbacks."""
        self._failed_attempts = 0
        outage = time.monotonic() - self._isolated_since if self._isolated_since is not None else 0.0
        self._isolated_since = None
        self.rejoins += 1
        logger.info("rejoined the swarm: %d peer(s) answered after %.0fs cut off", answered, outage)
        for callback in list(self.on_rejoined):
            try:
                await callback()
            except Exception as e:
                logger.warning("after rejoining: %s", e)

    async def _ping_missing_initial_peers(self, present: set[str]) -> None:
        missing = [(m, p) for m, p in self.node.initial_peer_ids.items() if p not in present and p != self.node.peer_id]
        if missing:
            await asyncio.gather(*(self.node.connect(p, [m]) for m, p in missing))
            await asyncio.gather(
                *(self.node.dht.protocol.call_ping(PeerID.from_base58(p)) for _, p in missing), return_exceptions=True
            )

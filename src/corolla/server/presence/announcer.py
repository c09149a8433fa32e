"""Keeping this server's DHT record fresh: announce now, then every `period` seconds until stopped.

A failed announce (the DHT unreachable) is retried sooner: after 1 s, then doubling up to `period`. A store can
also "succeed" while the node is cut off (it stores into its own table, the only one it reaches), so that is not
the whole story: the node's SwarmWatch notices the empty routing table, rejoins when the network is back, and calls
`refresh_soon()`; the record is then back in the DHT at once, not up to a period later.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from hivemind.dht.node import DHTNode

from corolla.dht.model_index import ModelRecord
from corolla.dht.records import announce_blocks
from corolla.dht.replicas import ReplicaSet
from corolla.protocol.messages import ServerInfo

logger = logging.getLogger(__name__)

FIRST_RETRY = 1.0  # seconds before the first retry of a failed announce


def retry_delay(failures: int, period: float) -> float:
    """Seconds to wait after `failures` consecutive failed announces (0 = the last one succeeded)."""
    if failures <= 0:
        return period
    return min(period, FIRST_RETRY * 2 ** (failures - 1))


class Announcer:
    def __init__(
        self,
        dht: DHTNode,
        prefix: str,
        peer_id: str,
        make_info: Callable[[], ServerInfo],
        period: float,
        expiration: float,
        model: ModelRecord | None = None,
    ):
        """`model`: this server's entry in the swarm's model index (dht.model_index), refreshed with every announce."""
        self.dht = dht
        self.prefix = prefix
        self.peer_id = peer_id
        self.make_info = make_info
        self.period = period
        self.expiration = expiration
        self.model = model
        self.replicas = ReplicaSet()  # where the last announce stored each record (stored there again, no search)
        self._wake = asyncio.Event()
        self.failures = 0  # consecutive failed periodic announces

    async def announce(self) -> bool:
        """Store the current record under every hosted block; True when every store succeeded."""
        info = self.make_info()
        ok = await announce_blocks(self.dht, self.prefix, self.peer_id, info, self.expiration, self.model,
                                   replicas=self.replicas)
        logger.debug(
            "announced state=%s blocks=%d:%d free_tokens=%d ok=%s",
            info.state.value,
            info.start_block,
            info.end_block,
            info.cache_tokens_free,
            ok,
        )
        return ok

    def refresh_soon(self) -> None:
        """Ask the loop to announce at once (e.g. after a big change in free cache, or after rejoining the swarm)."""
        self._wake.set()

    async def announce_soon(self) -> None:
        """refresh_soon() as a coroutine (a callback of SwarmWatch.on_rejoined): after an outage the nodes that
        held our records may be gone, so every key is searched for again."""
        self.replicas.forget()
        self.refresh_soon()

    async def run(self) -> None:
        """Announce periodically until cancelled; a failed store is retried sooner (see the module docstring)."""
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), retry_delay(self.failures, self.period))
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            try:
                ok = await self.announce()
                error = None if ok else "a DHT store was refused or unanswered"
            except Exception as e:  # the DHT may be unreachable; keep serving and retry
                error = str(e) or type(e).__name__
            if error is None:
                if self.failures:
                    logger.info("announced again after %d failed attempt(s)", self.failures)
                self.failures = 0
                continue
            self.failures += 1
            log = logger.warning if self.failures == 1 else logger.debug
            log("announce failed (%s); retrying in %.0fs", error, retry_delay(self.failures, self.period))

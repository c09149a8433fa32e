"""Keeping this server's DHT record fresh: announce now, then every `period` seconds until stopped."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from hivemind.dht.node import DHTNode

from corolla.dht.model_index import ModelRecord
from corolla.dht.records import announce_blocks
from corolla.protocol.messages import ServerInfo

logger = logging.getLogger(__name__)


class Announcer:
    def __init__(self, dht: DHTNode, prefix: str, peer_id: str, make_info: Callable[[], ServerInfo], period: float, expiration: float,
                 model: ModelRecord | None = None):
        """`model`: this server's entry in the swarm's model index (dht.model_index), refreshed with every announce."""
        self.dht = dht
        self.prefix = prefix
        self.peer_id = peer_id
        self.make_info = make_info
        self.period = period
        self.expiration = expiration
        self.model = model
        self._wake = asyncio.Event()

    async def announce(self) -> bool:
        """Store the current record under every hosted block; True when every store succeeded."""
        info = self.make_info()
        ok = await announce_blocks(self.dht, self.prefix, self.peer_id, info, self.expiration, self.model)
        logger.debug("announced state=%s blocks=%d:%d free_tokens=%d ok=%s", info.state.value, info.start_block, info.end_block, info.cache_tokens_free, ok)
        return ok

    def refresh_soon(self) -> None:
        """Ask the loop to announce at once (e.g. after a big change in free cache)."""
        self._wake.set()

    async def run(self) -> None:
        """Announce periodically until cancelled; a failed store is retried at the next period."""
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.period)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            try:
                await self.announce()
            except Exception as e:  # the DHT may be briefly unreachable; keep serving and retry
                logger.warning("announce failed: %s", e)

"""Who serves what: a cached view of the swarm, peer bans with backoff, and routes on demand.

All methods run on the client's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from corolla.client.config import ClientConfig
from corolla.client.routing import Span, find_route, uncovered_blocks
from corolla.dht import SwarmNode, fetch_block_servers
from corolla.protocol.errors import MissingBlocks
from corolla.protocol.messages import ServerInfo

logger = logging.getLogger(__name__)


@dataclass
class _Ban:
    until: float
    failures: int


class SequenceManager:
    def __init__(self, node: SwarmNode, prefix: str, num_blocks: int, config: ClientConfig):
        self.node = node
        self.prefix = prefix
        self.num_blocks = num_blocks
        self.config = config
        self.block_servers: list[dict[str, ServerInfo]] = [{} for _ in range(num_blocks)]
        self.last_update = -float("inf")
        self._bans: dict[str, _Ban] = {}
        self._update_lock = asyncio.Lock()

    async def update(self, force: bool = False) -> None:
        """Re-read every block's servers from the DHT (at most once per update_period unless forced)."""
        async with self._update_lock:
            if not force and time.monotonic() - self.last_update < self.config.update_period:
                return
            self.block_servers = await fetch_block_servers(self.node.dht, self.prefix, range(self.num_blocks))
            self.last_update = time.monotonic()
            logger.debug("swarm view updated: %s", [len(s) for s in self.block_servers])

    def banned(self) -> set[str]:
        now = time.monotonic()
        return {peer for peer, ban in self._bans.items() if ban.until > now}

    def ban(self, peer_id: str) -> None:
        """Avoid `peer_id` for a while: min_backoff after its first failure, doubling with each further one."""
        ban = self._bans.get(peer_id)
        failures = ban.failures + 1 if ban else 1
        duration = min(self.config.max_backoff, self.config.min_backoff * 2 ** (failures - 1))
        self._bans[peer_id] = _Ban(until=time.monotonic() + duration, failures=failures)
        logger.info("banned peer=%s for %.1fs after %d failure(s)", peer_id, duration, failures)

    def forgive(self, peer_id: str) -> None:
        """A successful request resets the peer's backoff."""
        self._bans.pop(peer_id, None)

    async def make_route(self, start: int, end: int, cache_tokens_needed: int = 0) -> list[Span]:
        """A chain of spans covering [start, end); waits up to missing_blocks_wait for servers, then MissingBlocks.

        Banned peers are skipped, unless a block would be left with no server at all: then bans are ignored
        rather than failing (a ban must never make the model unusable).
        """
        await self.update()
        deadline = time.monotonic() + self.config.missing_blocks_wait
        while True:
            banned = self.banned()
            route = find_route(
                self.block_servers, start, end, banned=banned, cache_tokens_needed=cache_tokens_needed, hop_cost=self.config.hop_cost
            )
            if route is None and banned:
                route = find_route(self.block_servers, start, end, cache_tokens_needed=cache_tokens_needed, hop_cost=self.config.hop_cost)
            if route is not None:
                return route
            if time.monotonic() >= deadline:
                raise MissingBlocks(uncovered_blocks(self.block_servers, start, end))
            await asyncio.sleep(0.25)
            await self.update(force=True)

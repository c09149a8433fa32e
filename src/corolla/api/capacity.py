"""Whether the swarm has room for a new session right now, from the servers' live rpc_info answers.

The engine asks before opening a session when it keeps finished sessions or wants headroom: if no server of
some block could reserve the session's tokens at once, it gives up kept sessions (they may be what fills the
servers) and drops the headroom, instead of waiting in a full server's allocation queue. A server that does
not answer is left out; a block none of whose servers answered counts as having room (giving up sessions would
not help there).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Mapping, Sequence

from corolla.client.swarm.routing import usable_servers
from corolla.client.swarm.server_info import request_info
from corolla.protocol.messages import InfoReply, ServerInfo, ServerState

logger = logging.getLogger(__name__)


def has_room(block_servers: Sequence[Mapping[str, ServerInfo]], free: Mapping[str, int], tokens: int,
             adapter: str | None = None, allowed_quant: Sequence[str] | None = None) -> bool:
    """True if every block has a usable server whose free cache `free[peer]` is at least `tokens`, or whose
    servers all went unheard (not in `free`)."""
    for block in range(len(block_servers)):
        heard = [free[peer] for peer, _ in usable_servers(block_servers, block, adapter=adapter,
                                                          allowed_quant=allowed_quant) if peer in free]
        if heard and max(heard) < tokens:
            return False
    return True


class SwarmCapacity:
    """Live free cache of the servers a model's sessions may use (via its SequenceManager, on the client loop)."""

    def __init__(self, manager: Any, timeout: float = 2.0):
        self.manager = manager  # corolla.client.swarm.sequence_manager.SequenceManager
        self.timeout = timeout

    async def free_cache(self) -> dict[str, int]:
        """Free cache tokens of every ONLINE server of the model that answers, by peer id."""
        await self.manager.update()
        servers = self.manager.block_servers
        peers = sorted(
            {peer for by_peer in servers for peer, info in by_peer.items() if info.state == ServerState.ONLINE}
        )
        replies = await asyncio.gather(
            *(request_info(self.manager.node.p2p, peer, self.timeout) for peer in peers), return_exceptions=True
        )
        free = {
            peer: reply.info.cache_tokens_free for peer, reply in zip(peers, replies) if isinstance(reply, InfoReply)
        }
        logger.debug("capacity.free %s", free)
        return free

    def fits(self, free: Mapping[str, int], tokens: int) -> bool:
        """Could a session of `tokens` cache tokens open on every block without waiting (see has_room)?"""
        config = self.manager.config
        return has_room(self.manager.block_servers, free, tokens, config.active_adapter, config.allowed_quant)

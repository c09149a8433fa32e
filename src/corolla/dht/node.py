"""One P2P daemon and one DHT node living in the caller's asyncio loop.

hivemind's `DHT` class forks a process per node; we run `DHTNode` in our own loop instead, so a server or client
is one Python process (plus the p2pd daemon hivemind spawns, which shares our process group).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Sequence

from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P

logger = logging.getLogger(__name__)

DHT_SHUTDOWN_TIMEOUT = 5.0  # seconds


@dataclass(eq=False)
class SwarmNode:
    p2p: P2P
    dht: DHTNode

    @property
    def peer_id(self) -> str:
        """This node's peer id in base58 (the DHT subkey under which a server announces itself)."""
        return self.p2p.peer_id.to_base58()

    async def maddrs(self) -> list[str]:
        """Full multiaddrs other peers can dial, each ending in /p2p/<peer id>."""
        return [str(m) for m in await self.p2p.get_visible_maddrs()]

    async def shutdown(self) -> None:
        """Stop the DHT node and the p2pd daemon; safe to call twice.

        The DHT node's shutdown never returns once p2pd is gone (e.g. a SIGTERM sent to the whole process group
        reached it first), so it gets a few seconds, and p2pd is shut down in any case.
        """
        try:
            await asyncio.wait_for(self.dht.shutdown(), DHT_SHUTDOWN_TIMEOUT)
        except asyncio.TimeoutError:
            logger.warning("the DHT node did not stop within %.0fs (p2pd already gone?)", DHT_SHUTDOWN_TIMEOUT)
        finally:
            await self.p2p.shutdown()


async def create_swarm_node(
    initial_peers: Sequence[str] = (),
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    client_mode: bool = False,
    announce_maddrs: Sequence[str] | None = None,
) -> SwarmNode:
    """Start p2pd listening on host:port (0 = OS-assigned) and a DHT node joined to `initial_peers`.

    Raises ValueError for an unparsable multiaddr, and hivemind's error when no initial peer answers.
    NAT traversal, relays and IPFS bootstrap stay off: a swarm is reached only through the addresses it is given.
    """
    peers = [str(p).strip() for p in initial_peers if str(p).strip()]
    for peer in peers:
        if "/p2p/" not in peer:
            raise ValueError(f"initial peer {peer!r} is not a full multiaddr (expected /ip4/HOST/tcp/PORT/p2p/PEERID)")
    proto = "ip6" if ":" in host else "ip4"
    p2p = await P2P.create(
        initial_peers=peers or None,
        host_maddrs=[f"/{proto}/{host}/tcp/{port}"],
        announce_maddrs=list(announce_maddrs) if announce_maddrs else None,
        nat_port_map=False,
        auto_nat=False,
        use_relay=False,
        use_ipfs=False,
    )
    try:
        dht = await DHTNode.create(p2p=p2p, initial_peers=peers or None, client_mode=client_mode, num_workers=4)
    except BaseException:
        await p2p.shutdown()
        raise
    node = SwarmNode(p2p=p2p, dht=dht)
    logger.debug("dht node started peer_id=%s client_mode=%s", node.peer_id, client_mode)
    return node

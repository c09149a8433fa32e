"""Asking one server directly what it holds (rpc_info): fresher than its DHT record."""

from __future__ import annotations

from hivemind.p2p import P2P

from corolla.client.swarm.connection import Connection
from corolla.protocol.errors import PeerUnavailable
from corolla.protocol.messages import InfoReply, InfoRequest


async def request_info(p2p: P2P, peer_id: str, timeout: float = 10.0) -> InfoReply:
    """The server's live InfoReply (state, blocks, free cache, sessions); PeerUnavailable if it does not answer."""
    connection = await Connection.open(p2p, peer_id, "info", timeout)
    try:
        await connection.send(InfoRequest())
        reply, _ = await connection.receive(timeout)
    finally:
        connection.close()
    if not isinstance(reply, InfoReply):
        raise PeerUnavailable(f"server {peer_id} answered rpc_info with {reply.kind}")
    return reply

"""Asking a peer what it serves: one rpc_info exchange (an InfoRequest answered by an InfoReply) on a fresh stream.

Clients and servers time these to rank routes (dht.ping); storing nodes ask the writers of the records they keep
(dht.verifier). Only the peer itself answers: the stream goes to its authenticated peer id.
"""

from __future__ import annotations

import asyncio
import time

from hivemind.p2p import P2P, PeerID

from corolla.protocol import rpc_handler_name
from corolla.protocol.errors import PeerUnavailable, PeerUnreachable, ProtocolError
from corolla.protocol.framing import read_frame, write_frame
from corolla.protocol.messages import InfoReply, InfoRequest

MAX_INFO_BYTES = 1 << 20  # an InfoReply is a few KiB (more with many adapters)


async def ask_info(p2p: P2P, peer_id: str, timeout: float) -> InfoReply:
    """`peer_id`'s InfoReply, within `timeout` seconds from the start (stream opening included).

    Raises PeerUnreachable when no stream to the peer opens in time (or the peer id is malformed), PeerUnavailable when
    it does not answer with an InfoReply in time."""
    begin = time.perf_counter()
    try:
        _, reader, writer = await asyncio.wait_for(
            p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), rpc_handler_name("info")), timeout)
    except Exception as e:  # a timeout, a malformed id, or p2pd's assorted exception types for a peer it cannot reach
        raise PeerUnreachable(f"could not open a stream to {peer_id}: {e!r}") from e
    try:
        await write_frame(writer, InfoRequest())
        left = max(0.0, timeout - (time.perf_counter() - begin))
        reply, _ = await asyncio.wait_for(read_frame(reader, MAX_INFO_BYTES), left)
    except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError, RuntimeError,
            ProtocolError) as e:
        raise PeerUnavailable(f"{peer_id} did not answer rpc_info: {e!r}") from e
    finally:
        try:
            writer.close()
        except (ConnectionError, RuntimeError, OSError):
            pass
    if not isinstance(reply, InfoReply):
        raise PeerUnavailable(f"{peer_id} answered rpc_info with {reply.kind}")
    return reply

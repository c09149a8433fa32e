"""A peer without the swarm key trying to use a server it knows the address of (run inside an emulated host).

    python stranger.py SERVER_MAADDR

Starts a bare P2P node (no DHT, no key), dials the server and tries rpc_info and then to open an inference
session; prints one JSON line: {"info": <outcome>, "session": <outcome>}, each outcome "accepted" or the error.
"""

from __future__ import annotations

import asyncio
import json
import sys


async def attempt(p2p, peer_id: str, verb: str, message) -> str:
    from corolla.client.swarm.connection import Connection

    try:
        connection = await Connection.open(p2p, peer_id, verb, timeout=20.0)
        try:
            await connection.send(message)
            reply, _ = await connection.receive(timeout=20.0)
        finally:
            connection.close()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return f"accepted: {reply.kind}"


async def main(server_maddr: str) -> dict[str, str]:
    from hivemind.p2p import P2P

    from corolla.dht.maddrs import peer_id_of
    from corolla.dht.node import dial
    from corolla.protocol import PROTOCOL_VERSION
    from corolla.protocol.messages import BlockRange, InfoRequest, OpenSession

    p2p = await P2P.create(host_maddrs=["/ip4/0.0.0.0/tcp/0"], nat_port_map=False, auto_nat=False, use_relay=False,
                           use_ipfs=False)
    try:
        peer_id = peer_id_of(server_maddr)
        dialed = await dial(p2p, peer_id, [server_maddr])
        open_session = OpenSession(protocol_version=PROTOCOL_VERSION, blocks=BlockRange(start=0, end=2), max_length=16)
        return {"dialed": dialed, "info": await attempt(p2p, peer_id, "info", InfoRequest()),
                "session": await attempt(p2p, peer_id, "inference", open_session)}
    finally:
        await p2p.shutdown()


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1]))), flush=True)

"""server.rpc.push.PushPool over loopback sockets: a next server that hangs up its push stream makes the next push to it
fail at once (NextServerGone), without a dial (a dead peer's dial costs round trips), and only that one push: the
push after redials, so a live server that dropped the stream is pushed to again."""

from __future__ import annotations

import asyncio


from corolla.protocol.messages import CloseSession
from corolla.server.rpc import push
from corolla.server.rpc.push import NextServerGone, PushPool

PEER = "12D3KooWHYj9hcvpLxNuZEstA8yTyxXzqDGstUw3TTUswiEog4Dx"


class LoopbackP2P:
    """`call_binary_stream_handler` opening a TCP connection to a local server instead of a libp2p stream."""

    def __init__(self, port: int):
        self.port, self.dials = port, 0

    async def call_binary_stream_handler(self, peer, name):
        self.dials += 1
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        return None, reader, writer


async def hang_up_scenario(fresh: float) -> tuple[list[str], int]:
    """Open a pooled stream, let the peer hang it up, push twice; returns each push's outcome and the dials made."""
    connections: list[asyncio.StreamWriter] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    p2p = LoopbackP2P(server.sockets[0].getsockname()[1])
    pool = PushPool(p2p, timeout=5.0)
    outcomes = []
    try:
        await pool.send(PEER, CloseSession(), {})
        connections[0].close()  # the next server hangs up (its process died, or it dropped the stream)
        for _ in range(100):  # the pool's reader sees the end a few loop turns later
            if PEER not in pool._streams:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(fresh)
        for _ in range(2):
            try:
                await pool.send(PEER, CloseSession(), {})
                outcomes.append("sent")
            except NextServerGone:
                outcomes.append("gone")
    finally:
        pool.close()
        server.close()
        await server.wait_closed()
    return outcomes, p2p.dials


def test_a_push_right_after_the_next_server_hung_up_fails_at_once_and_the_one_after_redials():
    outcomes, dials = asyncio.run(hang_up_scenario(0.0))
    assert outcomes == ["gone", "sent"] and dials == 2  # the first dial, then the redial of the second push


def test_a_hang_up_older_than_hung_up_fresh_is_redialled_at_once(monkeypatch):
    monkeypatch.setattr(push, "HUNG_UP_FRESH", 0.05)
    outcomes, dials = asyncio.run(hang_up_scenario(0.1))
    assert outcomes == ["sent", "sent"] and dials == 2

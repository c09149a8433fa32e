"""The part of hivemind's P2P that a server's handlers and a client's Connection use, in memory (no p2pd), for
tests that only need to reach a server's handlers: `add_binary_stream_handler` / `remove_binary_stream_handler` per
peer (what `ConnectionHandler.register` calls) and `call_binary_stream_handler` (what `Connection.open` calls),
each stream a pair of in-memory pipes. A handler name a peer has not registered fails as p2pd's does ("protocols
not supported"), which Connection turns into PeerUnreachable.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from hivemind.p2p import PeerID


class MemoryWriter:
    """The writing end of an in-memory pipe: what is written is fed to the other side's StreamReader; closing it is
    the other side's end of stream."""

    transport = None  # abort_stream: nothing is buffered here to drop

    def __init__(self, peer_reader: asyncio.StreamReader) -> None:
        self._peer = peer_reader
        self._closed = False

    def write(self, data: bytes) -> None:
        if self._closed:
            raise ConnectionResetError("stream closed")
        self._peer.feed_data(data)

    async def drain(self) -> None:
        if self._closed:
            raise ConnectionResetError("stream closed")
        await asyncio.sleep(0)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._peer.feed_eof()

    def is_closing(self) -> bool:
        return self._closed

    async def wait_closed(self) -> None:
        pass


class MemoryP2P:
    """Peers with stream handlers, and streams to them from one calling peer (`caller`), all in this process."""

    def __init__(self, caller: str) -> None:
        self.caller = PeerID.from_base58(caller)
        self._handlers: dict[tuple[str, str], object] = {}
        self.streams: list[asyncio.Task[None]] = []  # one per stream: the handler serving it

    def peer(self, peer_id: str) -> SimpleNamespace:
        """The registration calls of one peer (what ConnectionHandler.register gets as its P2P)."""
        async def add(name: str, handler) -> None:
            self._handlers[(peer_id, name)] = handler

        async def remove(name: str) -> None:
            self._handlers.pop((peer_id, name), None)

        return SimpleNamespace(add_binary_stream_handler=add, remove_binary_stream_handler=remove)

    async def call_binary_stream_handler(self, peer_id: PeerID, name: str):
        """(stream info, reader, writer) of a new stream to `name` on `peer_id`, served by its handler in a task."""
        handler = self._handlers.get((peer_id.to_base58(), name))
        if handler is None:
            raise RuntimeError(f"failed to negotiate protocol: protocols not supported: [{name}]")
        to_server, to_client = asyncio.StreamReader(), asyncio.StreamReader()
        info = SimpleNamespace(peer_id=self.caller)
        self.streams.append(asyncio.ensure_future(handler(info, to_server, MemoryWriter(to_client))))
        return info, to_client, MemoryWriter(to_server)

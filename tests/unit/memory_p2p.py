"""The part of hivemind's P2P that a server's handlers and a client's Connection use, in memory (no p2pd), for
tests that only need to reach servers' handlers: `add_binary_stream_handler` / `remove_binary_stream_handler` per
peer (what `ConnectionHandler.register` calls) and `call_binary_stream_handler` (what `Connection.open` calls, and
what a server's push pool calls to reach the next server), each stream a pair of in-memory pipes. A handler name a
peer has not registered fails as p2pd's does ("protocols not supported"), which Connection turns into
PeerUnreachable. `crash(peer)` makes a peer vanish as a killed process does: its handlers are gone and every stream
it serves ends at once. `partition(peer)` cuts it off as a pulled cable does: nothing it sends or is sent arrives, no
stream ends, and a new stream to or from it never opens.
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
        self.silent = False  # cut off (MemoryP2P.partition): what is written, and the end of stream, never arrive

    def write(self, data: bytes) -> None:
        if self._closed:
            raise ConnectionResetError("stream closed")
        if not self.silent:
            self._peer.feed_data(data)

    async def drain(self) -> None:
        if self._closed:
            raise ConnectionResetError("stream closed")
        await asyncio.sleep(0)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if not self.silent:
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
        self._served: dict[str, list[tuple[asyncio.Task[None], MemoryWriter, MemoryWriter]]] = {}  # by server
        self._opened: dict[str, list[tuple[MemoryWriter, MemoryWriter]]] = {}  # streams by the peer that opened them
        self._cut: set[str] = set()  # peers partitioned off
        self._cut_open: set[str] = set()  # ...of which new streams still open (silent)

    def peer(self, peer_id: str) -> SimpleNamespace:
        """One peer's side of the P2P: its registration calls (what ConnectionHandler.register gets) and streams it
        opens to other peers (as itself)."""
        async def add(name: str, handler) -> None:
            self._handlers[(peer_id, name)] = handler

        async def remove(name: str) -> None:
            self._handlers.pop((peer_id, name), None)

        async def call(target: PeerID, name: str):
            return await self._call(PeerID.from_base58(peer_id), target, name)

        return SimpleNamespace(add_binary_stream_handler=add, remove_binary_stream_handler=remove,
                               call_binary_stream_handler=call)

    async def call_binary_stream_handler(self, peer_id: PeerID, name: str):
        """(stream info, reader, writer) of a new stream to `name` on `peer_id`, served by its handler in a task."""
        return await self._call(self.caller, peer_id, name)

    async def _call(self, caller: PeerID, peer_id: PeerID, name: str):
        target = peer_id.to_base58()
        if target in self._cut_open:  # opened at once over the connection held, and nothing ever comes back
            silent = MemoryWriter(asyncio.StreamReader())
            silent.silent = True
            return SimpleNamespace(peer_id=caller), asyncio.StreamReader(), silent
        if target in self._cut or caller.to_base58() in self._cut:
            await asyncio.Event().wait()  # a dial into (or out of) a cut-off host never completes
        handler = self._handlers.get((target, name))
        if handler is None:
            raise RuntimeError(f"failed to negotiate protocol: protocols not supported: [{name}]")
        to_server, to_client = asyncio.StreamReader(), asyncio.StreamReader()
        info = SimpleNamespace(peer_id=caller)
        server_writer, client_writer = MemoryWriter(to_client), MemoryWriter(to_server)
        task = asyncio.ensure_future(handler(info, to_server, server_writer))
        self.streams.append(task)
        self._served.setdefault(target, []).append((task, server_writer, client_writer))
        self._opened.setdefault(caller.to_base58(), []).append((server_writer, client_writer))
        return info, to_client, client_writer

    def crash(self, peer_id: str) -> None:
        """`peer_id` is gone at once, as a killed process: no handler answers for it, every stream it served ends
        (both ways: its readers see the end too), its handler tasks are cancelled."""
        for key in [k for k in self._handlers if k[0] == peer_id]:
            del self._handlers[key]
        for task, server_writer, client_writer in self._served.pop(peer_id, []):
            task.cancel()
            server_writer.close()
            client_writer.close()
        for server_writer, client_writer in self._opened.pop(peer_id, []):  # its pushes to others end too
            server_writer.close()
            client_writer.close()

    def partition(self, peer_id: str, streams_open: bool = False) -> None:
        """`peer_id` is cut off the network, as by a pulled cable: every stream it serves or opened goes silent both
        ways (no data, no end of stream: the other side just waits), and no new stream to or from it opens; with
        `streams_open`, new streams to it open at once and stay silent (p2pd opens a stream over a connection it
        already holds without a round trip)."""
        self._cut.add(peer_id)
        if streams_open:
            self._cut_open.add(peer_id)
        for _, server_writer, client_writer in self._served.get(peer_id, []):
            server_writer.silent = client_writer.silent = True
        for server_writer, client_writer in self._opened.get(peer_id, []):
            server_writer.silent = client_writer.silent = True

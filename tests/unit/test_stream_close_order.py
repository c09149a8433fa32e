"""A server's stream handler closes its end only after the client closed its own (or after LINGER_TIMEOUT).

Closing first lost replies on a busy machine: p2pd turns the server's close into a FIN followed by a reset, and a
reset that reaches the client's p2pd before it copied the reply out discards the reply (the client saw "server ...
closed the stream" from rpc_info about once in 1000 calls under load). Here the two ends are a socket pair.
"""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace

import pytest

from corolla.protocol.framing import read_frame, write_frame
from corolla.protocol.messages import ErrorCode, ErrorReply, InfoRequest
from corolla.server.rpc import handler as handler_module
from corolla.server.metrics import ServerMetrics

STREAM_INFO = SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: "client-peer"))


async def _pair():
    a, b = socket.socketpair()
    server_end = await asyncio.open_unix_connection(sock=a)
    client_end = await asyncio.open_unix_connection(sock=b)
    return server_end, client_end


async def _answer(reader, writer, peer):
    await read_frame(reader)
    await write_frame(writer, ErrorReply(code=ErrorCode.BAD_REQUEST, message="answered"))


def test_the_server_closes_only_after_the_client_closed():
    async def run():
        (s_reader, s_writer), (c_reader, c_writer) = await _pair()
        serving = asyncio.create_task(handler_module._stream_adapter(_answer, "info", ServerMetrics())(STREAM_INFO, s_reader, s_writer))
        await write_frame(c_writer, InfoRequest())
        reply, _ = await read_frame(c_reader)
        await asyncio.sleep(0.2)
        still_open = not serving.done() and not s_writer.is_closing()
        c_writer.close()
        await asyncio.wait_for(serving, 2.0)
        return reply, still_open, s_writer.is_closing()

    reply, still_open, closed_after = asyncio.run(run())
    assert isinstance(reply, ErrorReply) and reply.message == "answered"
    assert still_open, "the server closed its end before the client did"
    assert closed_after


def test_a_client_that_never_closes_is_closed_after_the_linger_timeout(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(handler_module, "LINGER_TIMEOUT", 0.3)

    async def run():
        (s_reader, s_writer), (c_reader, c_writer) = await _pair()
        serving = asyncio.create_task(handler_module._stream_adapter(_answer, "info", ServerMetrics())(STREAM_INFO, s_reader, s_writer))
        await write_frame(c_writer, InfoRequest())
        await read_frame(c_reader)
        await write_frame(c_writer, InfoRequest())  # more bytes after the reply are read and dropped
        await asyncio.wait_for(serving, 3.0)
        eof = await asyncio.wait_for(c_reader.read(), 3.0)  # the server's end is gone: EOF, nothing more
        c_writer.close()
        return eof

    assert asyncio.run(run()) == b""

"""client.swarm.connection: one reader per stream. A second reader, or any reader found already waiting on the stream,
never fails a session with asyncio's RuntimeError: it is PeerUnavailable (the client routes around the stream) with a
warning naming the peer. A receive that timed out or was cancelled leaves nothing reading the stream.

Over a bare asyncio.StreamReader fed by the test: no network, no server, no sleeps.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from corolla.client.swarm.connection import Connection
from corolla.protocol.errors import PeerUnavailable
from corolla.protocol.framing import LEN_BYTES, encode_frame
from corolla.protocol.messages import PushSet

PEER = "12D3KooWTestPeerOfTheStream"


class NullWriter:
    """A writer nobody reads (these tests only receive)."""

    def write(self, data: bytes) -> None:
        pass

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


def frame(message=None) -> bytes:
    payload = encode_frame(message or PushSet(), {})
    return len(payload).to_bytes(LEN_BYTES, "big") + payload


async def until_waiting(reader: asyncio.StreamReader) -> None:
    """Let the loop run until something waits for the reader's data (a few turns)."""
    for _ in range(100):
        if reader._waiter is not None:  # asyncio's own record of the coroutine waiting for data
            return
        await asyncio.sleep(0)
    raise AssertionError("nobody started reading the stream")


def run(coro):
    return asyncio.run(coro)


def test_a_second_receive_while_one_waits_is_peer_unavailable_with_a_warning_and_the_first_gets_its_frame(caplog):
    async def scenario():
        reader = asyncio.StreamReader()
        connection = Connection(PEER, reader, NullWriter())  # type: ignore[arg-type]
        first = asyncio.ensure_future(connection.receive(60))
        await until_waiting(reader)
        with pytest.raises(PeerUnavailable, match=PEER):
            await connection.receive(60)
        reader.feed_data(frame())
        message, _ = await first
        return message

    with caplog.at_level(logging.WARNING, logger="corolla.client.swarm.connection"):
        assert isinstance(run(scenario()), PushSet)
    assert any(PEER in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


def test_a_reader_that_receive_does_not_know_of_makes_it_peer_unavailable_not_runtime_error(caplog):
    """The safety net: asyncio's "readexactly() called while another coroutine is already waiting for incoming data"
    (a reader outside `receive`) is the stream being unusable, never an error that fails the session."""
    async def scenario():
        reader = asyncio.StreamReader()
        connection = Connection(PEER, reader, NullWriter())  # type: ignore[arg-type]
        other = asyncio.ensure_future(reader.readexactly(LEN_BYTES))
        await until_waiting(reader)
        try:
            with pytest.raises(PeerUnavailable, match=PEER) as raised:
                await connection.receive(60)
        finally:
            other.cancel()
            await asyncio.gather(other, return_exceptions=True)
        return raised.value

    with caplog.at_level(logging.WARNING, logger="corolla.client.swarm.connection"):
        error = run(scenario())
    assert isinstance(error.__cause__, RuntimeError) and "another coroutine" in str(error.__cause__)
    assert any(PEER in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


def test_a_timed_out_receive_leaves_nothing_reading_and_the_next_receive_reads_the_next_frame():
    async def scenario():
        reader = asyncio.StreamReader()
        connection = Connection(PEER, reader, NullWriter())  # type: ignore[arg-type]
        with pytest.raises(PeerUnavailable, match="did not answer"):
            await connection.receive(0.01)  # nothing is ever fed before it: it always times out
        assert reader._waiter is None
        reader.feed_data(frame())
        message, _ = await connection.receive(60)
        return message

    assert isinstance(run(scenario()), PushSet)


def test_a_cancelled_receive_leaves_nothing_reading_and_the_next_receive_reads_the_next_frame():
    async def scenario():
        reader = asyncio.StreamReader()
        connection = Connection(PEER, reader, NullWriter())  # type: ignore[arg-type]
        receiving = asyncio.ensure_future(connection.receive(60))
        await until_waiting(reader)
        receiving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await receiving
        assert reader._waiter is None
        reader.feed_data(frame())
        message, _ = await connection.receive(60)
        return message

    assert isinstance(run(scenario()), PushSet)

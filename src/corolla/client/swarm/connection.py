"""A client's end of one RPC stream: typed send/receive of messages and their named tensors, with timeouts and
error mapping.

A stream has one reader at a time. Two coroutines reading it at once would split its frames between them, so the
client's callers never let that happen (a background reader is stopped and awaited before anyone else reads:
client.chain.pass_pipe, client.chain.standby; concurrent requests on several spans end together before any of those
spans is used again: client.chain.chain.fix_links). Should a second reader come anyway, `receive` does not let it
fail the session: it names the peer in a warning and raises PeerUnavailable, so the client routes around the stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

import torch
from hivemind.p2p import P2P, PeerID

from corolla.protocol import PROTOCOL_VERSION, rpc_handler_name
from corolla.protocol.errors import PeerUnavailable, PeerUnreachable, ProtocolError, RemoteError
from corolla.protocol.framing import read_frame, write_frame
from corolla.protocol.messages import ErrorReply, Message

_NO_TENSORS: dict[str, torch.Tensor] = {}
T = TypeVar("T")

logger = logging.getLogger(__name__)


class Connection:
    def __init__(self, peer_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.peer_id = peer_id
        self.reader = reader
        self.writer = writer
        self._reading = False  # a `receive` is reading the stream now (one reader at a time)

    @classmethod
    async def open(cls, p2p: P2P, peer_id: str, verb: str, timeout: float) -> Connection:
        """Open a stream to `verb` on the peer; PeerUnreachable if that fails or takes over `timeout` seconds
        (naming our protocol version when the peer has no handler for it: it runs another corolla protocol)."""
        name = rpc_handler_name(verb)
        try:
            _, reader, writer = await asyncio.wait_for(
                p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), name), timeout
            )
        except asyncio.TimeoutError:
            raise PeerUnreachable(f"server {peer_id} did not accept a stream within {timeout:.1f}s") from None
        except Exception as e:  # p2pd reports unreachable peers with assorted exception types
            if "protocols not supported" in str(e):
                raise PeerUnreachable(
                    f"server {peer_id} does not speak corolla protocol v{PROTOCOL_VERSION} (it has no "
                    f"{name} handler): it runs a corolla version with another protocol"
                ) from e
            raise PeerUnreachable(f"could not reach server {peer_id}: {e}") from e
        return cls(peer_id, reader, writer)

    async def send(
        self, message: Message, tensors: Mapping[str, torch.Tensor] = _NO_TENSORS, codec: str = "none"
    ) -> int:
        """Send a message and its tensors by name (the names its kind carries; hidden states in `codec`); returns the
        frame's bytes. PeerUnavailable if the stream broke."""
        try:
            return await write_frame(self.writer, message, tensors, codec)
        except (ConnectionError, RuntimeError, OSError) as e:
            raise PeerUnavailable(f"stream to server {self.peer_id} broke: {e}") from e

    async def receive(self, timeout: float) -> tuple[Message, dict[str, torch.Tensor]]:
        """Next message and its tensors by name (framing has checked the names against its kind); ErrorReply becomes
        RemoteError, a closed or silent stream or a malformed frame PeerUnavailable.

        The frame is read in the calling task (Python >= 3.11): once `receive` returned or raised (a timeout, a
        cancellation), nothing reads the stream for it any more. A second `receive` while one is reading, or any
        other reader found waiting on the stream, is a bug of the caller: logged as a warning naming the peer, and
        PeerUnavailable (the stream's frames are no longer known to be whole), never an error that fails the
        session."""
        if self._reading:
            logger.warning("concurrent read of the stream from server %s: a second reader while one is waiting; "
                           "treating the stream as broken", self.peer_id)
            raise PeerUnavailable(f"stream from server {self.peer_id} is being read by another coroutine")
        self._reading = True
        try:
            message, tensors = await _within(read_frame(self.reader), timeout)
        except asyncio.TimeoutError:
            raise PeerUnavailable(f"server {self.peer_id} did not answer within {timeout:.1f}s") from None
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as e:
            raise PeerUnavailable(f"server {self.peer_id} closed the stream") from e
        except ProtocolError as e:
            raise PeerUnavailable(f"server {self.peer_id} sent a malformed frame: {e}") from e
        except RuntimeError as e:  # asyncio's "readexactly() called while another coroutine is already waiting"
            logger.warning("reading the stream from server %s failed: %s; treating the stream as broken",
                           self.peer_id, e)
            raise PeerUnavailable(f"stream from server {self.peer_id} broke: {e}") from e
        finally:
            self._reading = False
        if isinstance(message, ErrorReply):
            raise RemoteError(message.code, message.message, peer=self.peer_id)
        return message, tensors

    def close(self) -> None:
        try:
            self.writer.close()
        except (ConnectionError, RuntimeError, OSError):
            pass


async def _within(coro: Coroutine[Any, Any, T], timeout: float) -> T:
    """Await `coro` in this task, raising asyncio.TimeoutError after `timeout` seconds.

    Not `asyncio.wait_for` where `asyncio.timeout` exists (Python >= 3.11): wait_for runs `coro` in a task of its
    own, and on Python < 3.12 it swallows a cancellation that arrives as that task finishes, so a cancelled reader
    goes on to read the next frame while its canceller believes it stopped."""
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(timeout):
            return await coro
    return await asyncio.wait_for(coro, timeout)

"""A client's end of one RPC stream: typed send/receive with timeouts and error mapping."""

from __future__ import annotations

import asyncio
import logging
from typing import Sequence

import torch
from hivemind.p2p import P2P, PeerID

from corolla.protocol import rpc_handler_name
from corolla.protocol.errors import PeerUnavailable, PeerUnreachable, ProtocolError, RemoteError
from corolla.protocol.framing import read_frame, write_frame
from corolla.protocol.messages import ErrorReply, Message

logger = logging.getLogger(__name__)


class Connection:
    def __init__(self, peer_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.peer_id = peer_id
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, p2p: P2P, peer_id: str, verb: str, timeout: float) -> Connection:
        """Open a stream to `verb` on the peer; PeerUnreachable if that fails or takes over `timeout` seconds."""
        try:
            _, reader, writer = await asyncio.wait_for(
                p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), rpc_handler_name(verb)), timeout
            )
        except asyncio.TimeoutError:
            raise PeerUnreachable(f"server {peer_id} did not accept a stream within {timeout:.1f}s") from None
        except Exception as e:  # p2pd reports unreachable peers with assorted exception types
            raise PeerUnreachable(f"could not reach server {peer_id}: {e}") from e
        return cls(peer_id, reader, writer)

    async def send(self, message: Message, tensors: Sequence[torch.Tensor] = ()) -> None:
        try:
            await write_frame(self.writer, message, tensors)
        except (ConnectionError, RuntimeError, OSError) as e:
            raise PeerUnavailable(f"stream to server {self.peer_id} broke: {e}") from e

    async def receive(self, timeout: float) -> tuple[Message, list[torch.Tensor]]:
        """Next message; ErrorReply becomes RemoteError, a closed or silent stream PeerUnavailable."""
        try:
            message, tensors = await asyncio.wait_for(read_frame(self.reader), timeout)
        except asyncio.TimeoutError:
            raise PeerUnavailable(f"server {self.peer_id} did not answer within {timeout:.1f}s") from None
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as e:
            raise PeerUnavailable(f"server {self.peer_id} closed the stream") from e
        except ProtocolError as e:
            raise PeerUnavailable(f"server {self.peer_id} sent a malformed frame: {e}") from e
        if isinstance(message, ErrorReply):
            raise RemoteError(message.code.value, message.message, peer=self.peer_id)
        return message, tensors

    def close(self) -> None:
        try:
            self.writer.close()
        except (ConnectionError, RuntimeError, OSError):
            pass

"""A client's end of one RPC stream: typed send/receive of messages and their named tensors, with timeouts and
error mapping."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import torch
from hivemind.p2p import P2P, PeerID

from corolla.protocol import PROTOCOL_VERSION, rpc_handler_name
from corolla.protocol.errors import PeerUnavailable, PeerUnreachable, ProtocolError, RemoteError
from corolla.protocol.framing import read_frame, write_frame
from corolla.protocol.messages import ErrorReply, Message

_NO_TENSORS: dict[str, torch.Tensor] = {}

logger = logging.getLogger(__name__)


class Connection:
    def __init__(self, peer_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.peer_id = peer_id
        self.reader = reader
        self.writer = writer

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
    ) -> None:
        """Send a message and its tensors by name (the names its kind carries; hidden states in `codec`);
        PeerUnavailable if the stream broke."""
        try:
            await write_frame(self.writer, message, tensors, codec)
        except (ConnectionError, RuntimeError, OSError) as e:
            raise PeerUnavailable(f"stream to server {self.peer_id} broke: {e}") from e

    async def receive(self, timeout: float) -> tuple[Message, dict[str, torch.Tensor]]:
        """Next message and its tensors by name (framing has checked the names against its kind); ErrorReply becomes
        RemoteError, a closed or silent stream or a malformed frame PeerUnavailable."""
        try:
            message, tensors = await asyncio.wait_for(read_frame(self.reader), timeout)
        except asyncio.TimeoutError:
            raise PeerUnavailable(f"server {self.peer_id} did not answer within {timeout:.1f}s") from None
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as e:
            raise PeerUnavailable(f"server {self.peer_id} closed the stream") from e
        except ProtocolError as e:
            raise PeerUnavailable(f"server {self.peer_id} sent a malformed frame: {e}") from e
        if isinstance(message, ErrorReply):
            raise RemoteError(message.code, message.message, peer=self.peer_id)
        return message, tensors

    def close(self) -> None:
        try:
            self.writer.close()
        except (ConnectionError, RuntimeError, OSError):
            pass

"""What every RPC handler of one server shares (`ServerParts`), and the two ways a handler talks on a stream: the
first message of a stream, read within a deadline and bounded before it is read (`read_first`), and one frame
written within a deadline, past which a peer that stopped reading has its stream aborted (`send`).

The handlers themselves: stream acceptance and registration in server.rpc.handler, inference sessions in
server.rpc.inference, pushed steps in server.rpc.push_receiver, stateless calls in server.rpc.stateless.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TypeVar

import torch

from corolla.protocol.framing import MAX_FRAME_BYTES, abort_stream, read_frame, write_frame
from corolla.protocol.messages import ErrorCode, Message
from corolla.protocol.signing import PeerKey
from corolla.server.compute.adapter_calls import AdapterCalls
from corolla.server.compute.block_stack import BlockStack
from corolla.server.compute.emulation import Emulator
from corolla.server.compute.planner import PlanLimits
from corolla.server.compute.scheduling import Compute
from corolla.server.config import ServerConfig
from corolla.server.errors import RequestError
from corolla.server.metrics import ServerMetrics
from corolla.server.rpc.faults import FaultInjector
from corolla.server.rpc.peer_limits import PeerLimits
from corolla.server.rpc.push import PushLinks, PushPool
from corolla.server.rpc.sessions import SessionTable
from corolla.server.rpc.validation import RequestChecks

logger = logging.getLogger(__name__)

FIRST_MESSAGE_TIMEOUT = 30.0  # seconds a new stream may take to say what it wants
_M = TypeVar("_M", bound=Message)


@dataclass(eq=False)
class ServerParts:
    """One server's state that its RPC handlers share (built once by server.rpc.handler.ConnectionHandler)."""

    config: ServerConfig
    stack: BlockStack
    checks: RequestChecks  # every check on what a client sends
    table: SessionTable  # open sessions, their reservations and caches
    links: PushLinks  # open sessions that accept pushes, by their source (server.rpc.push)
    compute: Compute  # the scheduler, or the fault injector around it
    faults: FaultInjector | None  # --inject-fault (None: an honest server)
    emulator: Emulator  # forwards computed as another kind of server (spot checks)
    adapters: AdapterCalls
    limits: PlanLimits
    peer_limits: PeerLimits
    metrics: ServerMetrics
    key: PeerKey  # this server's peer-id key: it signs the receipts of its pushes
    first_message_timeout: float  # seconds a new stream may take to say what it wants
    pushes: PushPool | None = None  # streams to next servers, once registered on a P2P node
    # the codecs a next server announces (server.presence.next_hops; unknown: "none"), for protocol.codecs.bulk_codec
    push_codecs: Callable[[str], Collection[str]] = lambda peer: ("none",)  # noqa: E731 (an instance attribute)
    shutting_down: bool = False  # new sessions are refused

    async def read_first(
        self, reader: asyncio.StreamReader, kind: type[_M], max_bytes: int = MAX_FRAME_BYTES
    ) -> tuple[_M, dict[str, torch.Tensor]]:
        """The first message of a stream (see `read_first`), within first_message_timeout."""
        return await read_first(reader, kind, max_bytes, self.first_message_timeout)

    async def send(
        self,
        writer: asyncio.StreamWriter,
        message: Message,
        tensors: Mapping[str, torch.Tensor] | None = None,
        codec: str = "none",
    ) -> None:
        """One frame, within the session timeout (see `send`)."""
        await send(writer, message, tensors or {}, self.config.session_timeout, codec)


async def read_first(
    reader: asyncio.StreamReader,
    kind: type[_M],
    max_bytes: int = MAX_FRAME_BYTES,
    timeout: float = FIRST_MESSAGE_TIMEOUT,
) -> tuple[_M, dict[str, torch.Tensor]]:
    """The first message of a stream, which must be a `kind`, and its tensors; TimeoutError after `timeout` seconds."""
    message, tensors = await asyncio.wait_for(read_frame(reader, max_bytes=max_bytes), timeout)
    if not isinstance(message, kind):
        raise RequestError(
            ErrorCode.BAD_REQUEST, f"this stream takes {kind.model_fields['kind'].default}, got {message.kind}"
        )
    return message, tensors


async def send(
    writer: asyncio.StreamWriter,
    message: Message,
    tensors: Mapping[str, torch.Tensor],
    timeout: float,
    codec: str = "none",
) -> None:
    """Write one frame. A peer that has not taken it within `timeout` seconds stopped reading: its stream is aborted
    (dropping what is buffered for it) and ConnectionAbortedError ends the handler."""
    try:
        await asyncio.wait_for(write_frame(writer, message, tensors, codec), timeout)
    except asyncio.TimeoutError:
        logger.info("stream aborted: the peer took no data for %.0fs", timeout)
        abort_stream(writer)
        raise ConnectionAbortedError(f"the peer took no data for {timeout:.0f}s") from None

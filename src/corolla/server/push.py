"""Server-to-server push: a step's output goes straight to the next server of the client's route (rpc_push).

    client ──step + route──► A ──PushStep──► B ──PushStep──► C
       ▲                     │               │               │
       └──── StepResult ─────┴───────────────┴───────────────┘   (each server answers its own client stream;
                                                                   the client waits only for the last one)

Who may push into a session: only the peer its owner named (OpenSession.push_from, or AllowPush on the session's own
stream, which only the owner holds). The stream handler knows the pushing peer's authenticated id, so a stranger
cannot inject steps into somebody else's session (`authorize_push`). Pushes to one next server share one persistent
stream (`PushPool`), not a stream per step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from hivemind.p2p import PeerID

from corolla.protocol import rpc_handler_name
from corolla.protocol.framing import abort_stream, read_frame, write_frame
from corolla.protocol.messages import ErrorCode, ErrorReply, Message, PushHop, PushStep
from corolla.server.sessions import ServerSession
from corolla.server.validation import RequestError

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class LiveSession:
    """An open session as pushes see it: the session, its owner's stream and who may push into it."""

    session: ServerSession
    writer: asyncio.StreamWriter  # the owner's rpc_inference stream: every result of this session goes there
    push_from: str | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one step at a time, in arrival order
    touched: float = field(default_factory=time.monotonic)  # when the owner or a push last sent a step (idle timeout)


def authorize_push(live: LiveSession | None, session_id: str, peer: str) -> LiveSession:
    """The session a push from `peer` into `session_id` may run in; RequestError if there is none or `peer` is not
    the one its owner named."""
    if live is None:
        raise RequestError(ErrorCode.BAD_REQUEST, f"push refused: no open session {session_id} on this server")
    if live.push_from is None or live.push_from != peer:
        raise RequestError(ErrorCode.BAD_REQUEST, f"push refused: the owner of session {session_id} did not name peer "
                                                  f"{peer} as allowed to push into it")
    return live


def next_push(push_to: tuple[PushHop, ...], position: int, hypo_ids: list[int] | None
              ) -> tuple[str, PushStep] | None:
    """(peer, message) to send this server's output to, for a step whose remaining route is `push_to`; None at the end."""
    if not push_to:
        return None
    hop, rest = push_to[0], tuple(push_to[1:])
    return hop.peer_id, PushStep(session_id=hop.session_id, step_id=hop.step_id, position=position,
                                 hypo_ids=hypo_ids, push_to=rest)


class PushPool:
    """One persistent rpc_push stream per next server; each has a task reading (and logging) its refusals."""

    def __init__(self, p2p, timeout: float):
        self.p2p = p2p
        self.timeout = timeout
        self._streams: dict[str, tuple[asyncio.StreamReader, asyncio.StreamWriter, asyncio.Task[None]]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.refusals: list[str] = []  # the last refusals pushes got (for logs and tests), newest last

    async def send(self, peer_id: str, message: Message, tensors: Mapping[str, torch.Tensor]) -> None:
        """Send one push to `peer_id` (a broken pooled stream is reopened once); raises on failure."""
        lock = self._locks.setdefault(peer_id, asyncio.Lock())
        async with lock:
            for attempt in range(2):
                _, writer, _ = await self._stream(peer_id)
                try:
                    await asyncio.wait_for(write_frame(writer, message, tensors), self.timeout)
                    return
                except (ConnectionError, RuntimeError, OSError, asyncio.TimeoutError):
                    self._drop(peer_id)
                    if attempt:
                        raise

    async def _stream(self, peer_id: str):
        if peer_id not in self._streams:
            _, reader, writer = await asyncio.wait_for(
                self.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), rpc_handler_name("push")), self.timeout)
            task = asyncio.create_task(self._read_refusals(peer_id, reader))
            self._streams[peer_id] = (reader, writer, task)
        return self._streams[peer_id]

    async def _read_refusals(self, peer_id: str, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                message, _ = await read_frame(reader)
                if isinstance(message, ErrorReply):
                    logger.info("push to %s refused: %s", peer_id, message.message)
                    self.refusals = [*self.refusals[-15:], message.message]
        except Exception:  # the stream ended: the next send reopens it (unless a send already replaced it)
            current = self._streams.get(peer_id)
            if current is not None and current[0] is reader:
                self._drop(peer_id, cancel=False)

    def _drop(self, peer_id: str, cancel: bool = True) -> None:
        entry = self._streams.pop(peer_id, None)
        if entry is not None:
            _, writer, task = entry
            # a stream is dropped when it failed, timed out or the pool closes: what is still buffered for the next
            # server is dropped with it (close() would hold the socket until a next server that stopped reading reads)
            abort_stream(writer)
            if cancel:
                task.cancel()

    def close(self) -> None:
        for peer_id in list(self._streams):
            self._drop(peer_id)

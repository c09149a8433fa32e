"""Server-to-server push: a step's output goes straight to the next server of the owner's route (rpc_push).

    client ──step (push)──► A ──PushStep──► B ──PushStep──► C
       ▲                    │               │               │
       └──── StepResult ────┴───────────────┴───────────────┘   (each server answers its own owner stream; the
                                                                  client waits only for the last one)

Who may push into a session, and where a session pushes, is set only by the session's owner, on its own stream
(OpenSession.push_from / push_to, or SetPush): each link A -> B of the route has a random secret the owner chose;
A's session pushes to B presenting it, and B's session accepts pushes only from peer A (the stream handler knows the
pushing peer's authenticated id) presenting it. A step only says whether to push on (`InferenceStep.push`), never
where. So a peer that learned a session's id can neither push into it, nor roll it back, nor read its outputs by
having an upstream server push into it on its behalf (`PushLinks.authorize`).

Every push carries the pusher's signed receipt of what it sent (protocol.receipts), which the receiver hands to the
owner with its answer: a corrupt push convicts its sender. Pushes to one next server share one persistent stream
(`PushPool`), not a stream per step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from hivemind.p2p import PeerID

from corolla.protocol import rpc_handler_name
from corolla.protocol.codecs import roundtrip
from corolla.protocol.framing import abort_stream, read_frame, write_frame
from corolla.protocol.messages import ErrorCode, ErrorReply, Message, PushRefusal, PushSource, PushStep, PushTarget
from corolla.protocol.receipts import receipt_signed, sign_receipt, tensor_digest
from corolla.protocol.signing import PeerKey
from corolla.server.rpc.sessions import ServerSession
from corolla.server.errors import RequestError

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class LiveSession:
    """An open session as pushes see it: the session, its owner's stream, who may push into it and where it pushes."""

    session: ServerSession
    writer: asyncio.StreamWriter  # the owner's rpc_inference stream: every result of this session goes there
    source: PushSource | None = None
    target: PushTarget | None = None
    codec: str = "none"  # how the session's hidden states travel (its answers and its pushes)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one step at a time, in arrival order
    touched: float = field(default_factory=time.monotonic)  # when the owner or a push last sent a step (idle timeout)


class PushLinks:
    """The open sessions of one server by their push links: by source (peer, secret) for pushes coming in, by target
    secret for pushes going out. Each link belongs to the first session that claimed it: a peer that learned another
    client's secret can neither receive that client's pushes here nor have this server push over that link for it."""

    def __init__(self, on_change: Callable[[], None] | None = None) -> None:
        self._by_source: dict[tuple[str, str], LiveSession] = {}
        self._by_target: dict[str, LiveSession] = {}
        self.on_change = on_change  # told whenever a session starts or stops accepting pushes from some peer

    def set_source(self, live: LiveSession, source: PushSource | None) -> None:
        """Make `live` accept pushes from `source` only (None: from nobody). RequestError if another open session
        already accepts pushes over that link (a secret is the owner's random choice: only a peer that learned
        someone else's would hit this)."""
        if source is not None:
            other = self._by_source.get((source.peer_id, source.secret))
            if other is not None and other is not live:
                raise RequestError(ErrorCode.BAD_REQUEST, "push refused: another session already uses this push link")
        self._drop_source(live)
        live.source = source
        if source is not None:
            self._by_source[(source.peer_id, source.secret)] = live
        if self.on_change is not None:
            self.on_change()

    def set_target(self, live: LiveSession, target: PushTarget | None) -> None:
        """Make `live` push its outputs to `target` (None: nowhere). RequestError if another open session already
        pushes over that link's secret (the confused deputy: a peer asking this server to push into a session over a
        link that belongs to somebody else's session here)."""
        if target is not None:
            other = self._by_target.get(target.secret)
            if other is not None and other is not live:
                raise RequestError(ErrorCode.BAD_REQUEST, "push refused: another session already pushes over this link")
        if live.target is not None and self._by_target.get(live.target.secret) is live:
            del self._by_target[live.target.secret]
        live.target = target
        if target is not None:
            self._by_target[target.secret] = live

    def drop(self, live: LiveSession) -> None:
        """`live` has no push links any more (it closes)."""
        self._drop_source(live)
        self.set_target(live, None)

    def _drop_source(self, live: LiveSession) -> None:
        if live.source is not None and self._by_source.get((live.source.peer_id, live.source.secret)) is live:
            del self._by_source[(live.source.peer_id, live.source.secret)]
            if self.on_change is not None:
                self.on_change()

    def accepting(self, peer: str) -> list[LiveSession]:
        """The sessions that accept pushes from `peer` (to bound what it may send before it is authorized)."""
        return [live for (source_peer, _), live in self._by_source.items() if source_peer == peer]

    def authorize(self, peer: str, secret: str) -> LiveSession:
        """The session a push from `peer` presenting `secret` goes to; RequestError if no open session accepts it."""
        live = self._by_source.get((peer, secret))
        if live is None:
            raise RequestError(ErrorCode.BAD_REQUEST, f"push refused: no open session here accepts pushes from {peer} "
                                                      "over this link (its owner did not name it)")
        return live


def outgoing_push(key: PeerKey, target: PushTarget, step_id: int, position: int, hypo_ids: list[int] | None,
                  push: bool, hidden: torch.Tensor, mask: torch.Tensor | None, codec: str = "none",
                  answer: int | None = None) -> tuple[PushStep, dict[str, torch.Tensor]]:
    """The PushStep (with this server's signed receipt) and tensors that carry `hidden` (B, T, H) on to `target` in
    `codec`; the receipt's digest is of what the receiver decodes."""
    tensors = {"hidden": hidden} if mask is None else {"hidden": hidden, "attention_mask": mask}
    receipt = sign_receipt(key, target.peer_id, target.secret, step_id, position, hypo_ids, push,
                           tensor_digest(roundtrip(codec, hidden), mask), answer)
    message = PushStep(secret=target.secret, step_id=step_id, position=position, hypo_ids=hypo_ids, push=push,
                       answer=answer, receipt=receipt)
    return message, tensors


def push_receipt_refusal(message: PushStep, tensors: Mapping[str, torch.Tensor], *, pusher: str, receiver: str
                         ) -> tuple[PushRefusal, str] | None:
    """None if the push's receipt is `pusher`'s signature of exactly this step, to us, of the tensors received; else
    why not (RECEIPT: it does not describe this push or is not the pusher's signature; DIGEST: the tensors are not the
    ones it signs) and what is wrong. A receiving server checks this before it runs a push, so the receipt it hands the
    owner with an answer always tells what it was given (the owner could not tell a bad receipt from its receiver
    lying)."""
    receipt = message.receipt
    if (receipt.pusher, receipt.receiver, receipt.step_id, receipt.position, receipt.hypo_ids, receipt.push,
            receipt.answer) != (pusher, receiver, message.step_id, message.position, message.hypo_ids, message.push,
                                message.answer):
        return PushRefusal.RECEIPT, "the receipt does not describe this push"
    if not receipt_signed(receipt, message.secret):
        return PushRefusal.RECEIPT, f"the receipt is not {pusher}'s signature"
    if receipt.digest != tensor_digest(tensors["hidden"], tensors.get("attention_mask")):
        return PushRefusal.DIGEST, "the receipt's digest is not the digest of the tensors pushed"
    return None


def push_receipt_problem(message: PushStep, tensors: Mapping[str, torch.Tensor], *, pusher: str, receiver: str
                         ) -> str | None:
    """What `push_receipt_refusal` finds wrong with a push's receipt, in words; None if nothing."""
    refusal = push_receipt_refusal(message, tensors, pusher=pusher, receiver=receiver)
    return None if refusal is None else refusal[1]


class NextServerGone(ConnectionError):
    """The next server hung up its push stream a moment ago: the push fails at once instead of redialling it."""


HUNG_UP_FRESH = 5.0  # seconds a next server's hang-up makes the next push to it fail at once (PushPool.send)


class PushPool:
    """One persistent rpc_push stream per next server; each has a task reading (and logging) its refusals.

    A stream the next server hung up (its end closed: the process died, or it dropped the stream) makes the next push
    to that server, within HUNG_UP_FRESH seconds, fail at once instead of redialling: the dial of a dead peer takes
    several round trips (0.21 s measured over 50 ms links, bench_standby), and the client, told the push failed, sends
    the step to that server itself (its own stream to it broke too if it died) and fails over to a standby or a
    replacement. Only that one push fails fast: if the server is alive, the client's relay reaches it and the push
    after redials."""

    def __init__(self, p2p, timeout: float):
        self.p2p = p2p
        self.timeout = timeout
        self._streams: dict[str, tuple[asyncio.StreamReader, asyncio.StreamWriter, asyncio.Task[None]]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._hung_up: dict[str, float] = {}  # peer -> when it closed our stream to it (time.monotonic)
        self.refusals: list[str] = []  # the last refusals pushes got (for logs and tests), newest last

    async def send(self, peer_id: str, message: Message, tensors: Mapping[str, torch.Tensor], codec: str = "none"
                   ) -> None:
        """Send one push to `peer_id`, hidden states in `codec` (a broken pooled stream is reopened once); raises on
        failure, NextServerGone at once when the peer hung up its stream within HUNG_UP_FRESH seconds (once)."""
        lock = self._locks.setdefault(peer_id, asyncio.Lock())
        async with lock:
            hung_up = self._hung_up.pop(peer_id, None)
            if hung_up is not None and peer_id not in self._streams and time.monotonic() - hung_up < HUNG_UP_FRESH:
                raise NextServerGone(f"{peer_id} hung up its push stream {time.monotonic() - hung_up:.3f}s ago")
            for attempt in range(2):
                _, writer, _ = await self._stream(peer_id)
                try:
                    await asyncio.wait_for(write_frame(writer, message, tensors, codec), self.timeout)
                    return
                except (ConnectionError, RuntimeError, OSError, asyncio.TimeoutError):
                    self._drop(peer_id)
                    if attempt:
                        raise

    async def _stream(self, peer_id: str):
        if peer_id not in self._streams:
            _, reader, writer = await asyncio.wait_for(
                self.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), rpc_handler_name("push")), self.timeout
            )
            task = asyncio.create_task(self._read_refusals(peer_id, reader))
            self._streams[peer_id] = (reader, writer, task)
        return self._streams[peer_id]

    async def _read_refusals(self, peer_id: str, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                message, _ = await read_frame(reader, max_bytes=1 << 16)
                if isinstance(message, ErrorReply):
                    logger.info("push to %s refused: %s", peer_id, message.message)
                    self.refusals = [*self.refusals[-15:], message.message]
        except Exception as e:  # the stream ended: the next send reopens it (unless a send already replaced it)
            current = self._streams.get(peer_id)
            if current is not None and current[0] is reader:
                logger.debug("push stream to %s ended by its end: %r", peer_id, e)
                now = time.monotonic()  # (hang-ups too old to matter are dropped: peers leave all the time)
                self._hung_up = {peer: at for peer, at in self._hung_up.items() if now - at < HUNG_UP_FRESH}
                self._hung_up[peer_id] = now
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

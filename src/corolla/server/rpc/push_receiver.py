"""rpc_push, the receiving end of server-to-server push (server.rpc.push): the previous server of owners' routes
sends their steps' inputs on one persistent stream, each run in the session whose owner named that link.

    PushStep ──► PushLinks.authorize (peer, secret) ──► push_receipt_problem ──► run_step (server.rpc.inference)
             ──► pushed on if asked ──► StepResult (with the pusher's receipt) on the OWNER's stream

A frame is bounded, before it is read, by the largest step a session accepting pushes from the pushing peer can
take (a peer no session names may send only a small header). A push that no session accepts is refused on this
stream, which ends after MAX_REFUSED_PUSHES of them in a row (one persistent stream carries many sessions' pushes:
ending it at the first push into a session that just closed would lose the others' pushes already on their way).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Mapping

import torch

from corolla.protocol.errors import ProtocolError
from corolla.protocol.framing import LEN_BYTES, abort_stream, decode_frame, write_frame
from corolla.protocol.messages import ErrorCode, ErrorReply, InferenceStep, PushRefusal, PushRefused, PushStep
from corolla.server.errors import RequestError
from corolla.server.rpc.inference import InferenceRpc, StaleStep, answered
from corolla.server.rpc.parts import ServerParts
from corolla.server.rpc.push import LiveSession, push_receipt_refusal
from corolla.server.rpc.push_budget import PushBudget

logger = logging.getLogger(__name__)

UNAUTHORIZED_PUSH_FRAME = 1 << 16  # bytes of a push frame from a peer no open session accepts pushes from
MAX_REFUSED_PUSHES = 8  # pushes nobody accepts, in a row, after which a push stream is ended


class PushReceiver:
    """rpc_push of one server; pushed steps run through `inference.run_step`, answered on their owners' streams."""

    def __init__(self, parts: ServerParts, inference: InferenceRpc):
        self.parts = parts
        self.inference = inference
        self.budget = PushBudget()  # bytes of pushed frames held, per pushing peer (server.rpc.push_budget)
        self.running: set[asyncio.Task[None]] = set()  # pushed steps running (each in its session, whatever the stream)

    def frame_limit(self, peer: str) -> int:
        """The largest push frame `peer` may send: the largest step of a session accepting its pushes (a small
        header for a peer no session names)."""
        checks = self.parts.checks
        return max(
            (
                checks.step_frame_limit(live.session.batch_size, live.session.max_length, live.session.num_blocks)
                for live in self.parts.links.accepting(peer)
            ),
            default=UNAUTHORIZED_PUSH_FRAME,
        )

    def allowance(self, peer: str) -> int:
        """What all of `peer`'s push frames may hold at once, in bytes: one step's frame per session accepting its
        pushes, or one small frame (server.rpc.push_budget)."""
        checks = self.parts.checks
        named = sum(
            checks.step_frame_limit(live.session.batch_size, live.session.max_length, live.session.num_blocks)
            for live in self.parts.links.accepting(peer)
        )
        return named or UNAUTHORIZED_PUSH_FRAME

    async def rpc_push(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str) -> None:
        """Steps pushed by `peer` on one persistent stream (see the module doc). Each frame is bounded before it is
        read, by `frame_limit` and by what `peer`'s frames hold already (`allowance`: waits for room, unread). A push
        over a link no session names is refused to `peer` on this stream; any other refusal also goes to the session's
        owner at once, as PushRefused naming the cause: a receipt that does not describe the push or is not `peer`'s
        signature (RECEIPT), tensors other than the ones it signs (DIGEST), a step id not newer than a step the session
        ran (STALE), a step the session cannot take (INPUT: not finite, past its length...). The session is left as
        it was, and the stream goes on; it ends after MAX_REFUSED_PUSHES refusals in a row."""
        parts = self.parts
        refused = 0  # pushes refused in a row on this stream
        while True:
            try:
                length = int.from_bytes(
                    await asyncio.wait_for(reader.readexactly(LEN_BYTES), parts.config.session_timeout), "big"
                )
            except asyncio.TimeoutError:
                return
            limit = self.frame_limit(peer)
            if length > limit:
                raise ProtocolError(f"frame of {length} bytes exceeds the limit of {limit} bytes")
            await self.budget.take(peer, length, lambda: self.allowance(peer), parts.config.session_timeout)
            handed_over = False
            try:
                payload = await asyncio.wait_for(reader.readexactly(length), parts.config.session_timeout)
                message, tensors = decode_frame(payload, limit)
                del payload
                if not isinstance(message, PushStep):
                    raise RequestError(ErrorCode.BAD_REQUEST, f"this stream takes push_step, got {message.kind}")
                problem = self._refusal(peer, message, tensors)
                if problem is not None:
                    refused += 1
                    live, cause, text = problem
                    if live is not None:
                        await self._tell_owner(live, message, cause, text)
                    if refused >= MAX_REFUSED_PUSHES:
                        raise RequestError(ErrorCode.BAD_REQUEST, f"{text} ({refused} refused pushes in a row: the "
                                                                  "stream ends)")
                    logger.info("push refused peer=%s reason=%s", peer, text)
                    await parts.send(writer, ErrorReply(code=ErrorCode.BAD_REQUEST, message=text))
                    continue
                refused = 0
                live = parts.links.authorize(peer, message.secret)
                task = asyncio.create_task(self._run_pushed(live, message, tensors))
                handed_over = True
                self.running.add(task)
                task.add_done_callback(self.running.discard)
                # this frame's own length: `length` is the next frame's by the time the step has run
                task.add_done_callback(functools.partial(self._give_back, peer, length))
            finally:
                if not handed_over:
                    self.budget.give_back(peer, length)

    def _give_back(self, peer: str, nbytes: int, _task: asyncio.Task[None]) -> None:
        self.budget.give_back(peer, nbytes)

    def _refusal(self, peer: str, message: PushStep, tensors: Mapping[str, torch.Tensor]
                 ) -> tuple[LiveSession | None, PushRefusal | None, str] | None:
        """Why a push is refused before it is queued: (the session it names or None, the cause to tell its owner,
        the reason); None if it may run. Pushes over an unnamed link have no owner to tell (an honest server's push
        into a session that has just gone, or somebody else's: the stream it shares with other sessions' pushes goes
        on either way, ending it would lose pushes already on their way)."""
        try:
            live = self.parts.links.authorize(peer, message.secret)
        except RequestError as e:
            return None, None, str(e)
        problem = push_receipt_refusal(message, tensors, pusher=peer, receiver=self.parts.key.peer_id)
        if problem is not None:
            return live, problem[0], f"push refused: {problem[1]}"
        return None

    async def _tell_owner(self, live: LiveSession, message: PushStep, cause: PushRefusal | None, text: str) -> None:
        """PushRefused to `live`'s owner, on its own stream, at once (not waiting for the session's running step:
        the owner's client reads its answers by step id). A failure to write it is the owner stream's problem."""
        refusal = PushRefused(step_id=message.step_id, reason=text[:1000], receipt=message.receipt,
                              cause=cause or PushRefusal.RECEIPT)
        logger.info("pushed step refused session=%s pusher=%s cause=%s: %s", live.session.id, message.receipt.pusher,
                    refusal.cause.value, text)
        try:
            await self.parts.send(live.writer, refusal)
        except (ConnectionError, OSError, RuntimeError) as e:
            logger.debug("could not tell session %s's owner of a refused push: %r", live.session.id, e)

    async def _run_pushed(self, live: LiveSession, message: PushStep, tensors: Mapping[str, torch.Tensor]) -> None:
        """Run a pushed step in `live`. A step the session cannot take (STALE: not newer than one it ran; INPUT: not
        finite, positions, length) is refused to its owner (PushRefused, the session unchanged); any other failure is
        the session's error (sent to its owner, its stream ended)."""
        parts = self.parts
        live.touched = time.monotonic()
        async with live.lock:
            try:
                step = InferenceStep(step_id=message.step_id, position=message.position, hypo_ids=message.hypo_ids)
                try:
                    result, output = await self.inference.run_step(live.session, step, tensors, pushed=True)
                except RequestError as e:
                    cause = PushRefusal.STALE if isinstance(e, StaleStep) else PushRefusal.INPUT
                    await self._tell_owner(live, message, cause, str(e))
                    return
                result = result.model_copy(update={"receipt": message.receipt})
                if message.push:
                    result = await self.inference.push_on(live, result, message, output, tensors.get("attention_mask"))
                await parts.send(live.writer, result, {"hidden": answered(live, message, output)}, live.codec)
            except (ConnectionError, asyncio.CancelledError):
                abort_stream(live.writer)
                raise
            except Exception as e:
                code, text = (
                    (e.code, str(e))
                    if isinstance(e, RequestError)
                    else (ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")
                )
                logger.info("pushed step failed session=%s: %s", live.session.id, text)
                try:
                    await asyncio.wait_for(write_frame(live.writer, ErrorReply(code=code, message=text)), 5.0)
                finally:
                    abort_stream(live.writer)

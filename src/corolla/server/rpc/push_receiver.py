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
import logging
import time
from collections.abc import Mapping

import torch

from corolla.protocol.framing import abort_stream, read_frame, write_frame
from corolla.protocol.messages import ErrorCode, ErrorReply, InferenceStep, PushRefused, PushStep
from corolla.server.errors import RequestError
from corolla.server.rpc.inference import InferenceRpc, answered
from corolla.server.rpc.parts import ServerParts
from corolla.server.rpc.push import LiveSession, push_receipt_problem

logger = logging.getLogger(__name__)

UNAUTHORIZED_PUSH_FRAME = 1 << 16  # bytes of a push frame from a peer no open session accepts pushes from
MAX_REFUSED_PUSHES = 8  # pushes nobody accepts, in a row, after which a push stream is ended


class PushReceiver:
    """rpc_push of one server; pushed steps run through `inference.run_step`, answered on their owners' streams."""

    def __init__(self, parts: ServerParts, inference: InferenceRpc):
        self.parts = parts
        self.inference = inference
        self.running: set[asyncio.Task[None]] = set()  # pushed steps running (each in its session, whatever the stream)

    async def rpc_push(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str) -> None:
        """Steps pushed by `peer` on one persistent stream (see the module doc). A push whose receipt is not the
        pusher's signature of what it sent is refused on this stream, which then ends. A pushed step the session
        cannot take (not finite, past its length...) goes to the owner as PushRefused, with the receipt, and leaves
        the session as it was."""
        parts = self.parts
        refused = 0  # pushes refused in a row on this stream
        while True:
            limit = max(
                (
                    parts.checks.step_frame_limit(
                        live.session.batch_size, live.session.max_length, live.session.num_blocks
                    )
                    for live in parts.links.accepting(peer)
                ),
                default=UNAUTHORIZED_PUSH_FRAME,
            )
            try:
                message, tensors = await asyncio.wait_for(read_frame(reader, limit), parts.config.session_timeout)
            except asyncio.TimeoutError:
                return
            if not isinstance(message, PushStep):
                raise RequestError(ErrorCode.BAD_REQUEST, f"this stream takes push_step, got {message.kind}")
            try:
                live = parts.links.authorize(peer, message.secret)
            except RequestError as e:
                # an honest server's push into a session that has gone (its owner closed or moved it meanwhile) is
                # refused, but the stream it shares with other sessions' pushes goes on: ending it would lose pushes
                # already on their way. A stream that keeps pushing what nobody accepts is ended.
                refused += 1
                if refused >= MAX_REFUSED_PUSHES:
                    raise RequestError(e.code, f"{e} ({refused} refused pushes in a row: the stream ends)") from None
                logger.info("push refused peer=%s reason=%s", peer, e)
                await parts.send(writer, ErrorReply(code=e.code, message=str(e)))
                continue
            refused = 0
            problem = push_receipt_problem(message, tensors, pusher=peer, receiver=parts.key.peer_id)
            if problem is not None:
                raise RequestError(ErrorCode.BAD_REQUEST, f"push refused: {problem}")
            task = asyncio.create_task(self._run_pushed(live, message, tensors))
            self.running.add(task)
            task.add_done_callback(self.running.discard)

    async def _run_pushed(self, live: LiveSession, message: PushStep, tensors: Mapping[str, torch.Tensor]) -> None:
        """Run a pushed step in `live`. A step the session cannot take is refused to its owner (PushRefused, the
        session unchanged); any other failure is the session's error (sent to its owner, its stream ended)."""
        parts = self.parts
        live.touched = time.monotonic()
        async with live.lock:
            try:
                step = InferenceStep(step_id=message.step_id, position=message.position, hypo_ids=message.hypo_ids)
                try:
                    result, output = await self.inference.run_step(live.session, step, tensors)
                except RequestError as e:
                    logger.info(
                        "pushed step refused session=%s pusher=%s: %s", live.session.id, message.receipt.pusher, e
                    )
                    await parts.send(
                        live.writer, PushRefused(step_id=message.step_id, reason=str(e)[:1000], receipt=message.receipt)
                    )
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

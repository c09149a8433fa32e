"""rpc_inference: one session per stream, from open_session to close_session, and every step run in a session
(`run_step`, whether its owner sent it or the previous server pushed it: server.rpc.push_receiver).

    OpenSession ──► RequestChecks.open_session ──► SessionTable.open (cache reserved, KV allocated) ──► SessionOpened
    then, until CloseSession, each frame of the owner (bounded by what one step of the session can hold):
    InferenceStep ──► run_step: RequestChecks.step ──► plan (server.compute.planner) ──► Compute.step
                  ──► pushed on to the session's target if asked (server.rpc.push) ──► StepResult (+ output)
    SetPush       ──► new push links (only the owner sets them) ──► PushSet

A session whose owner sends nothing for the session timeout ends (steps pushed into it count as activity); one
step of a session runs at a time (`LiveSession.lock`), in arrival order.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

import torch

from corolla.protocol.codecs import bulk_codec
from corolla.protocol.framing import read_frame
from corolla.protocol.messages import (
    CloseSession,
    ErrorCode,
    ErrorReply,
    InferenceStep,
    OpenSession,
    PushSet,
    PushStep,
    SessionOpened,
    SetPush,
    StepResult,
)
from corolla.server.compute.planner import plan
from corolla.server.errors import RequestError
from corolla.server.rpc.parts import ServerParts
from corolla.server.rpc.push import LiveSession, outgoing_push
from corolla.server.rpc.sessions import ServerSession

logger = logging.getLogger(__name__)


class InferenceRpc:
    """rpc_inference of one server, and the one path every session step takes (`run_step`)."""

    def __init__(self, parts: ServerParts):
        self.parts = parts

    async def rpc_inference(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str) -> None:
        """open_session, then inference steps until close_session: each step read, checked, planned, run, answered."""
        parts = self.parts
        request, _ = await parts.read_first(reader, OpenSession, max_bytes=1 << 16)
        if parts.shutting_down:
            raise RequestError(ErrorCode.SHUTTING_DOWN, "server is shutting down")
        parts.checks.open_session(request)
        async with parts.table.open(request, peer, alive=lambda: not reader.at_eof()) as session:
            frame_limit = parts.checks.step_frame_limit(session.batch_size, session.max_length, session.num_blocks)
            live = LiveSession(session, writer, codec=request.codec)
            try:
                parts.links.set_source(live, request.push_from)
                parts.links.set_target(live, request.push_to)
                await parts.send(writer, SessionOpened(session_id=session.id, max_length=session.max_length))
                await self._serve_session(reader, live, frame_limit)
            except asyncio.CancelledError:
                if session.dropped:  # a standby dropped for a primary's room (server.rpc.sessions): say so
                    await self._tell(writer, ErrorReply(code=ErrorCode.SERVER_FULL, message=(
                        "standby dropped: this server needs its cache for a primary session")))
                raise
            finally:
                parts.links.drop(live)

    async def _tell(self, writer: asyncio.StreamWriter, reply: ErrorReply) -> None:
        """Best effort, within a second: the stream is ending anyway."""
        try:
            await asyncio.wait_for(self.parts.send(writer, reply), 1.0)
        except Exception as e:  # the owner is gone or slow: nothing more to do
            logger.debug("could not tell the owner: %r", e)

    async def _serve_session(self, reader: asyncio.StreamReader, live: LiveSession, frame_limit: int) -> None:
        """The owner's frames of one session until close_session: steps (pushed on to its target) and SetPush."""
        parts = self.parts
        session, writer = live.session, live.writer
        timeout = parts.config.session_timeout
        reading: asyncio.Future | None = None
        try:
            while True:
                if reading is None:
                    reading = asyncio.ensure_future(read_frame(reader, frame_limit))
                done, _ = await asyncio.wait({reading}, timeout=timeout)
                if not done:
                    if time.monotonic() - live.touched < timeout:
                        continue  # steps pushed into the session keep it alive (its owner sends nothing here)
                    raise RequestError(ErrorCode.TIMEOUT, f"session idle for more than {timeout:.0f}s")
                message, tensors = reading.result()
                reading = None
                live.touched = time.monotonic()
                if isinstance(message, CloseSession):
                    return
                if isinstance(message, SetPush):
                    async with live.lock:
                        parts.links.set_source(live, message.source)
                        parts.links.set_target(live, message.target)
                        await parts.send(writer, PushSet())
                    continue
                if not isinstance(message, InferenceStep):
                    raise RequestError(ErrorCode.BAD_REQUEST, f"expected an inference step, got {message.kind}")
                async with live.lock:
                    result, output = await self.run_step(session, message, tensors)
                    if message.push:
                        result = await self.push_on(live, result, message, output, tensors.get("attention_mask"))
                    await parts.send(writer, result, {"hidden": answered(live, message, output)}, live.codec)
        finally:
            if reading is not None:
                reading.cancel()

    async def push_on(
        self,
        live: LiveSession,
        result: StepResult,
        message: InferenceStep | PushStep,
        output: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> StepResult:
        """Send a step's output on to the session's push target (the owner set it), with this server's signed receipt;
        the answer to the owner, naming a failed push. Nothing to do without a target (the route's last server)."""
        parts = self.parts
        target = live.target
        if target is None or parts.pushes is None:
            return result
        pushed = output if parts.faults is None else parts.faults.pushed(output)  # corrupt-push: a test's liar
        signed = output if parts.faults is not None and parts.faults.signs_honest_output else pushed
        codec = bulk_codec(live.codec, pushed.shape[1], parts.push_codecs(target.peer_id))
        push, tensors = outgoing_push(
            parts.key,
            target,
            message.step_id + (0 if parts.faults is None else parts.faults.pushed_step_offset),  # rewrite-push
            message.position,
            message.hypo_ids,
            True,
            signed,
            mask,
            codec,
            message.answer,
        )
        tensors["hidden"] = pushed  # misdigest-push: not what the receipt signs
        try:
            await parts.pushes.send(target.peer_id, push, tensors, codec)
        except Exception as e:  # the next server is gone: the client replaces it and relays this step
            logger.info("push to %s failed: %r", target.peer_id, e)
            return result.model_copy(update={"push_error": f"push to {target.peer_id} failed: {type(e).__name__}: {e}"})
        return result

    async def run_step(
        self,
        session: ServerSession,
        message: InferenceStep,
        tensors: Mapping[str, torch.Tensor],
        pushed: bool = False,
    ) -> tuple[StepResult, torch.Tensor]:
        """Check, plan and run one inference step of `session`, wherever it came from (`pushed`: the previous server
        pushed it); returns the answer and the blocks' output (B, T, H) in the dtype it was sent in. A step from an
        earlier position rolls the session back first.

        Steps run in the order of their ids (the owner numbers them from one counter; a pushed step keeps the id the
        owner gave it). The owner's own step may not be older than the last one run, so a push that arrives after the
        owner sent a newer step itself (a relayed retry, a failover) cannot overwrite what that step wrote; a pushed
        step must be strictly newer than every step the session ran, so the upstream server cannot replay or rewrite
        a step the owner already had answered (its answer would carry an id the owner has read past). Raises
        StaleStep for a step out of order, RequestError for any other step this session cannot take."""
        parts = self.parts
        if message.step_id < session.last_step_id or (pushed and message.step_id == session.last_step_id):
            raise StaleStep(
                ErrorCode.BAD_REQUEST,
                f"step {message.step_id} arrived after step {session.last_step_id}: a session's steps run in order"
                + (" and a pushed step must be newer than every step run" if pushed else ""),
            )
        step = parts.checks.step(
            message,
            tensors,
            batch_size=session.batch_size,
            held=session.position,
            max_length=session.max_length,
            num_blocks=session.num_blocks,
        )
        output = await parts.compute.step(session, step, plan(step, session, parts.limits))
        session.advance(step)
        return StepResult(step_id=step.step_id, position=session.position), output.to(step.hidden.dtype)


class StaleStep(RequestError):
    """A step whose id is not newer than the session's steps allow (see InferenceRpc.run_step)."""


def answered(live: LiveSession, message: InferenceStep | PushStep, output: torch.Tensor) -> torch.Tensor:
    """What of a step's output (B, T, H) goes back to the session's owner: all of it from a server that pushes the step
    on (the next server's input, which the owner keeps), else the last `message.answer` positions if asked."""
    if message.answer is None or (message.push and live.target is not None):
        return output
    return output[:, output.shape[1] - min(message.answer, output.shape[1]) :]  # (B, answer, H)

"""Attacks on push sessions (server.rpc.push) from a peer of the swarm: pushing into, rolling back or reading another
client's session through a server that pushes on the attacker's behalf, or pushing into it directly.

Each function runs on the attacker's own node (`SwarmNode`, on its event loop) and returns what the servers answered;
whether the victim was harmed is for the caller to check (its next tokens, its session's state). `push_frame_flood`
(attack 6 of issue 34) instead watches what the server holds while the attacker's own session's push link carries
many streams of frames as large as one step each.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import torch
from hivemind.p2p import PeerID

from corolla.dht.node import SwarmNode
from corolla.protocol import PROTOCOL_VERSION, rpc_handler_name
from corolla.protocol.framing import abort_stream, read_frame, write_frame
from corolla.protocol.messages import (BlockRange, CloseSession, ErrorReply, InferenceStep, Message, OpenSession,
                                       PushTarget, SessionOpened, StepResult)
from corolla.server.rpc.push import outgoing_push


@dataclass(frozen=True)
class PushAttempt:
    """What the attacked servers answered."""

    answers: tuple[str, ...]  # the kinds (and error texts) of every frame the attacker got back, in order
    outputs: tuple[torch.Tensor, ...]  # hidden states the attacker got back (another session's, if the attack worked)


async def _stream(node: SwarmNode, peer: str, verb: str):
    _, reader, writer = await asyncio.wait_for(
        node.p2p.call_binary_stream_handler(PeerID.from_base58(peer), rpc_handler_name(verb)), 30)
    return reader, writer


def _describe(message: Message) -> str:
    return f"error: {message.message}" if isinstance(message, ErrorReply) else message.kind


async def push_through_upstream(node: SwarmNode, upstream: str, blocks: tuple[int, int], victim: str, secret: str,
                                hidden: torch.Tensor, position: int = 0, timeout: float = 20.0) -> PushAttempt:
    """The confused deputy: open the attacker's own session on `upstream` (blocks), naming the victim's server as
    its push target with `secret` (a guess, or a secret the attacker learned), and send a step asking it to push on.
    An honest upstream pushes; the victim's server must refuse it unless its session's owner named that link."""
    reader, writer = await _stream(node, upstream, "inference")
    answers: list[str] = []
    outputs: list[torch.Tensor] = []
    try:
        await write_frame(
            writer,
            OpenSession(
                protocol_version=PROTOCOL_VERSION,
                blocks=BlockRange(start=blocks[0], end=blocks[1]),
                max_length=max(64, position + hidden.shape[1]),
                push_to=PushTarget(peer_id=victim, secret=secret),
            ),
        )
        opened, _ = await asyncio.wait_for(read_frame(reader), timeout)
        answers.append(_describe(opened))
        if not isinstance(opened, SessionOpened):
            return PushAttempt(tuple(answers), ())
        if position:  # fill the attacker's own session up to `position` first
            await write_frame(
                writer, InferenceStep(step_id=1, position=0), {"hidden": torch.zeros(1, position, hidden.shape[-1])}
            )
            reply, _ = await asyncio.wait_for(read_frame(reader), timeout)
            answers.append(_describe(reply))
        await write_frame(writer, InferenceStep(step_id=2, position=position, push=True), {"hidden": hidden})
        while True:  # the attacker's own answer, then whatever else comes (another session's output, if it leaked)
            try:
                reply, tensors = await asyncio.wait_for(read_frame(reader), 3.0 if outputs else timeout)
            except asyncio.TimeoutError:
                break
            answers.append(_describe(reply))
            if isinstance(reply, StepResult):
                outputs.append(tensors["hidden"])
            if isinstance(reply, ErrorReply):
                break
        await write_frame(writer, CloseSession())
    finally:
        writer.close()
    return PushAttempt(tuple(answers), tuple(outputs))


async def push_directly(
    node: SwarmNode,
    victim: str,
    secret: str,
    hidden: torch.Tensor,
    position: int,
    step_id: int = 1,
    timeout: float = 20.0,
) -> PushAttempt:
    """Push a step straight into the victim server over rpc_push, signed with the attacker's own key (so the
    receipt is valid, only the attacker is not the pusher the owner named)."""
    reader, writer = await _stream(node, victim, "push")
    try:
        message, tensors = outgoing_push(
            node.key, PushTarget(peer_id=victim, secret=secret), step_id, position, None, False, hidden, None
        )
        await write_frame(writer, message, tensors)
        reply, _ = await asyncio.wait_for(read_frame(reader), timeout)
        return PushAttempt((_describe(reply),), ())
    finally:
        writer.close()


async def unauthorized_push_frames(
    node: SwarmNode,
    victim: str,
    frames: int = 4,
    announced: int = 128 << 20,
    sent: int = 1 << 20,
    timeout: float = 20.0,
) -> str:
    """Open `frames` rpc_push streams to the victim, each announcing a frame of `announced` bytes and sending `sent`
    of them, from a peer no session names: a server that read such frames before authorizing them would hold
    frames x announced bytes. Returns the server's answers, joined."""
    streams = [await _stream(node, victim, "push") for _ in range(frames)]
    answers = []
    try:
        for _, writer in streams:
            writer.write(announced.to_bytes(8, "big") + b"\0" * sent)
        for reader, writer in streams:
            try:
                await writer.drain()
                reply, _ = await asyncio.wait_for(read_frame(reader), timeout)
                answers.append(_describe(reply))
            except (asyncio.TimeoutError, ConnectionError, asyncio.IncompleteReadError) as e:
                answers.append(f"no answer ({type(e).__name__})")
    finally:
        for _, writer in streams:
            writer.close()
    return "; ".join(answers)


@dataclass(frozen=True)
class FrameFlood:
    """What a push frame flood made a server hold."""

    frame_bytes: int  # the largest frame one step of the attacker's session can take
    streams: int
    sent: int  # bytes the server took from the attacker, all streams together
    rss_before: float  # MiB (the server process and its children)
    rss_peak: float
    answer: str  # what the attacker's own session stream said meanwhile ("silent" if nothing)


async def push_frame_flood(node: SwarmNode, server: str, server_pid: int, blocks: tuple[int, int], hidden_size: int,
                           batch_size: int, max_length: int, streams: int = 16, hold: float = 8.0,
                           chunk: int = 1 << 20) -> FrameFlood:
    """Attack 6: the attacker opens its own session on `server` (`batch_size` x `max_length` over `blocks`) naming
    itself as the session's push source, so one pushed frame may be as large as one step of it; then opens `streams`
    rpc_push streams and sends on each a frame of exactly that size, all of it but its last byte (it never completes,
    so a server that reads it holds it), for `hold` seconds, watching the server's memory. All streams are dropped
    before it returns."""
    import os
    import secrets

    from corolla.protocol.framing import HEADER_LEN_BYTES, LEN_BYTES, MAX_HEADER_BYTES
    from corolla.protocol.messages import PushSource
    from corolla.testing.server_attacks import process_rss_mib

    num_blocks = blocks[1] - blocks[0]
    frame = ((batch_size + num_blocks) * max_length * hidden_size * 4 + batch_size * max_length * 8
             + HEADER_LEN_BYTES + MAX_HEADER_BYTES)  # server.rpc.validation.step_frame_limit
    reader, writer = await _stream(node, server, "inference")
    flood: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    sent = [0] * streams
    try:
        await write_frame(writer, OpenSession(
            protocol_version=PROTOCOL_VERSION, blocks=BlockRange(start=blocks[0], end=blocks[1]),
            max_length=max_length, batch_size=batch_size, alloc_timeout=10.0,
            push_from=PushSource(peer_id=node.peer_id, secret=secrets.token_hex(16))))
        opened, _ = await asyncio.wait_for(read_frame(reader), 30)
        if not isinstance(opened, SessionOpened):
            raise RuntimeError(f"the attacker's session was refused: {_describe(opened)}")
        before = peak = process_rss_mib(server_pid)
        flood = [await _stream(node, server, "push") for _ in range(streams)]

        async def send(i: int, out: asyncio.StreamWriter) -> None:
            out.write(frame.to_bytes(LEN_BYTES, "big"))
            left = frame - 1
            while left > 0:
                piece = min(chunk, left)
                out.write(os.urandom(64) * (piece // 64) + b"\0" * (piece % 64))
                await out.drain()
                sent[i] += piece
                left -= piece

        tasks = [asyncio.create_task(send(i, out)) for i, (_, out) in enumerate(flood)]
        deadline = time.monotonic() + hold
        while time.monotonic() < deadline:
            await asyncio.sleep(0.25)
            peak = max(peak, process_rss_mib(server_pid))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        try:
            answer = _describe((await asyncio.wait_for(read_frame(reader), 0.5))[0])
        except asyncio.TimeoutError:
            answer = "silent"
    finally:
        for _, out in flood:
            abort_stream(out)
        writer.close()
    return FrameFlood(frame, streams, sum(sent), before, peak, answer)

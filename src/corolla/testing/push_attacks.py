"""Attacks on push sessions (server.rpc.push) from a peer of the swarm: pushing into, rolling back or reading another
client's session through a server that pushes on the attacker's behalf, or pushing into it directly.

Each function runs on the attacker's own node (`SwarmNode`, on its event loop) and returns what the servers answered;
whether the victim was harmed is for the caller to check (its next tokens, its session's state).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch
from hivemind.p2p import PeerID

from corolla.dht.node import SwarmNode
from corolla.protocol import PROTOCOL_VERSION, rpc_handler_name
from corolla.protocol.framing import read_frame, write_frame
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

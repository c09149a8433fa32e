"""The stateless RPCs: rpc_forward and rpc_backward (a pass over some of this server's blocks, no cache), rpc_info
(what this server is) and rpc_probe (another server measuring its bandwidth).

Each reads one request, bounded before it is read, checks it (server.rpc.validation), computes and answers:

    read_first ──► RequestChecks.stateless / .forward / .backward ──► Compute.forward / .backward ──► send
    (one pass slot of the peer held throughout: server.rpc.peer_limits)   (step_timeout at most)

A forward's or backward's frame is bounded by the tokens one call may carry (max_pass_tokens), a probe's by
max_probe_bytes, an info request's by 64 KiB.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from corolla.protocol.messages import (
    BackwardRequest,
    BackwardResult,
    ErrorCode,
    ForwardRequest,
    ForwardResult,
    InfoReply,
    InfoRequest,
    ProbeRequest,
)
from corolla.server.errors import RequestError, bad_request
from corolla.server.presence.network import send_probe_reply
from corolla.server.rpc.parts import ServerParts

_T = TypeVar("_T")


class StatelessRpc:
    """rpc_forward, rpc_backward, rpc_info and rpc_probe of one server."""

    def __init__(self, parts: ServerParts, describe: Callable[[], InfoReply]):
        self.parts = parts
        self.describe = describe  # what rpc_info answers (the server's current state)

    async def rpc_info(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str) -> None:
        await self.parts.read_first(reader, InfoRequest, max_bytes=1 << 16)
        await self.parts.send(writer, self.describe())

    async def rpc_probe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str) -> None:
        """Another server measuring its bandwidth: take its payload, send back the bytes it asks for (both at most
        max_probe_bytes; one probe per peer at a time, max_probes in all; the reply streamed, never held whole)."""
        parts = self.parts
        limit = parts.config.max_probe_bytes
        async with parts.peer_limits.probe(peer):
            request, _ = await parts.read_first(reader, ProbeRequest, max_bytes=limit + (1 << 16))
            if request.reply_bytes > limit:
                raise RequestError(
                    ErrorCode.BAD_REQUEST,
                    f"a probe reply of {request.reply_bytes} bytes exceeds this server's limit of {limit} bytes",
                )
            await send_probe_reply(writer, request.reply_bytes, parts.config.probe_stall_timeout)

    # Each call takes one of its peer's pass slots (server.rpc.peer_limits) before its frame is read, bounded by what
    # max_pass_tokens allows; its compute may take step_timeout at most.
    async def rpc_forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str) -> None:
        parts = self.parts
        async with parts.peer_limits.pass_slot(peer, parts.config.session_timeout):
            request, tensors = await parts.read_first(
                reader, ForwardRequest, parts.checks.pass_frame_limit(backward=False)
            )
            parts.checks.stateless(request)
            hidden, mask, prompts = parts.checks.forward(request, tensors)
            blocks = request.blocks
            if request.emulate is not None:
                bad_request(
                    parts.emulator.problem(request.emulate)
                    or (
                        "a forward computed as another kind of server takes no adapter, mask or deep prompts"
                        if request.emulate != parts.emulator.own
                        and (request.active_adapter or mask is not None or prompts is not None)
                        else None
                    )
                )
            output = await self._timed(
                parts.compute.forward(
                    hidden, blocks.start, blocks.end, request.active_adapter, prompts, mask, request.emulate
                )
            )
            await parts.send(writer, ForwardResult(), {"hidden": output.to(hidden.dtype)}, request.codec)

    async def rpc_backward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str) -> None:
        """hidden, grad_output (and an attention mask and deep prompts, as rpc_forward takes them) ->
        grad_hidden (and grad_prompts)."""
        parts = self.parts
        async with parts.peer_limits.pass_slot(peer, parts.config.session_timeout):
            request, tensors = await parts.read_first(
                reader, BackwardRequest, parts.checks.pass_frame_limit(backward=True)
            )
            parts.checks.stateless(request)
            hidden, grad_output, mask, prompts = parts.checks.backward(request, tensors)
            blocks = request.blocks
            grad_hidden, grad_prompts = await self._timed(
                parts.compute.backward(
                    hidden, grad_output, blocks.start, blocks.end, request.active_adapter, prompts, mask
                )
            )
            grads = {"grad_hidden": grad_hidden.to(hidden.dtype)}
            if grad_prompts is not None and prompts is not None:
                grads["grad_prompts"] = grad_prompts.to(prompts.dtype)
            await parts.send(writer, BackwardResult(), grads, request.codec)

    async def _timed(self, compute: Awaitable[_T]) -> _T:
        """`compute` (a forward or backward), abandoned with TIMEOUT after step_timeout seconds (a pass still queued
        is then never run)."""
        timeout = self.parts.config.step_timeout
        try:
            return await asyncio.wait_for(compute, timeout)
        except asyncio.TimeoutError:
            raise RequestError(ErrorCode.TIMEOUT, f"the pass took more than {timeout:.0f}s") from None

"""Autograd through the swarm: the forward runs span by span and remembers each span's inputs and server; the
backward sends each span's inputs and output gradient to rpc_backward, in reverse order.

    forward:  x0 ──► span A [0:2) ──► x1 ──► span B [2:4) ──► out          records: (A, x0), (B, x1)
    backward: g0 ◄── rpc_backward(A, x0, g1) ◄── g1 ◄── rpc_backward(B, x1, g_out) ◄── g_out

Servers keep nothing between the two passes (they recompute the forward inside rpc_backward), so a server that
fails during backward is banned and its span re-routed like a forward: the replacement route's intermediate inputs
are recomputed with rpc_forward, then its spans are differentiated in reverse.

A padded batch sends its attention mask (B, T) with every request; each row then sees only its real tokens, and
the gradient at a padded slot passes straight through.

Messages stay small: a batch is split along its batch dimension into chunks whose (B_i, T, H) hidden states take at
most ClientConfig.max_chunk_bytes (one row at least), and each chunk runs its own chain of requests. Per-row
results are independent, so chunking changes no number; deep-prompt gradients are summed over the chunks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from corolla.client.swarm.connection import Connection
from corolla.client.event_loop import run_sync
from corolla.client.swarm.routing import Span
from corolla.client.swarm.sequence_manager import SequenceManager
from corolla.protocol import PROTOCOL_VERSION
from corolla.protocol.errors import PeerUnavailable, RemoteError
from corolla.protocol.messages import (
    BackwardRequest,
    BackwardResult,
    BlockRange,
    ComputeKind,
    ForwardRequest,
    ForwardResult,
)

logger = logging.getLogger(__name__)


def chunk_sizes(batch: int, row_bytes: int, max_bytes: int) -> list[int]:
    """Split `batch` rows into consecutive chunks of at most max(1, max_bytes // row_bytes) rows each.

    >>> chunk_sizes(5, row_bytes=100, max_bytes=250)
    [2, 2, 1]
    """
    per_chunk = max(1, max_bytes // max(1, row_bytes))
    return [min(per_chunk, batch - offset) for offset in range(0, batch, per_chunk)]


@dataclass
class SpanRecord:
    """What one span of a forward was sent: its server's span, its inputs (b, T, H) and the chunk's attention mask
    (b, T) or None."""

    span: Span
    inputs: Tensor
    mask: Tensor | None = None


class RemoteBlocks:
    """Forward and backward passes over blocks [start, end) of the swarm, with the forward's retry policy.

    `prompts` everywhere is None or the deep prompts of all blocks [start, end): (end - start, P, H); `mask` is
    None or the attention mask (bool, on the CPU) of the hidden states it comes with.
    """

    def __init__(self, manager: SequenceManager, start: int, end: int):
        self.manager = manager
        self.start = start
        self.end = end

    # ------------------------------------------------------------------ whole batches, chunked
    async def forward(self, hidden: Tensor, prompts: Tensor | None, mask: Tensor | None = None
                      ) -> tuple[Tensor, list[list[SpanRecord]]]:
        """hidden (B, T, H) -> (output (B, T, H), per chunk the records its backward needs)."""
        sizes = chunk_sizes(
            hidden.shape[0], hidden[0].numel() * hidden.element_size(), self.manager.config.max_chunk_bytes
        )
        masks = [None] * len(sizes) if mask is None else mask.split(sizes)
        results = await asyncio.gather(
            *(self.forward_chunk(part, prompts, part_mask) for part, part_mask in zip(hidden.split(sizes), masks))
        )
        return torch.cat([out for out, _ in results]), [records for _, records in results]

    async def backward(
        self, chunks: list[list[SpanRecord]], grad_output: Tensor, prompts: Tensor | None
    ) -> tuple[Tensor, Tensor | None]:
        """Gradients w.r.t. the forward's hidden (B, T, H) and prompts, given grad_output (B, T, H)."""
        sizes = [records[0].inputs.shape[0] for records in chunks]
        results = await asyncio.gather(
            *(self.backward_chunk(records, grad, prompts) for records, grad in zip(chunks, grad_output.split(sizes)))
        )
        grad_hidden = torch.cat([grad for grad, _ in results])
        grad_prompts = None if prompts is None else torch.stack([gp for _, gp in results]).sum(0)
        return grad_hidden, grad_prompts

    # ------------------------------------------------------------------ one chunk
    async def forward_chunk(
        self, hidden: Tensor, prompts: Tensor | None, mask: Tensor | None = None
    ) -> tuple[Tensor, list[SpanRecord]]:
        """Run hidden (b, T, H) through blocks [start, end), re-routing around failing servers."""
        block, x, failures, records = self.start, hidden, 0, []
        while block < self.end:
            route = await self.manager.make_forward_route(block, self.end)
            for span in route:
                try:
                    begin = time.perf_counter()  # routing: the span's measured time (SequenceManager.observe)
                    out = await self.forward_span(span, x, self._prompts_of(prompts, span), mask)
                except (PeerUnavailable, RemoteError) as e:
                    failures = self.manager.after_failure(e, failures, span)
                    await self.manager.backoff(failures)
                    break  # re-route from `block`
                self.manager.observe(span.peer_id, time.perf_counter() - begin, span.length, x.shape[0] * x.shape[1])
                self.manager.forgive(span.peer_id)
                records.append(SpanRecord(span, x, mask))
                x, block = out, span.end
        return x, records

    async def backward_chunk(
        self, records: list[SpanRecord], grad: Tensor, prompts: Tensor | None
    ) -> tuple[Tensor, Tensor | None]:
        """Backpropagate grad (b, T, H) through the recorded spans in reverse; returns (grad_hidden, grad_prompts)."""
        grad_prompts = None if prompts is None else torch.zeros_like(prompts)
        for record in reversed(records):
            span = record.span
            try:
                grad, span_grad = await self.backward_span(
                    span, record.inputs, grad, self._prompts_of(prompts, span), record.mask
                )
                self.manager.forgive(span.peer_id)
                self._accumulate(grad_prompts, span, span_grad)
            except (PeerUnavailable, RemoteError) as e:
                failures = self.manager.after_failure(e, 0, span)
                await self.manager.backoff(failures)
                grad = await self._backward_rerouted(
                    span.start, span.end, record, grad, prompts, grad_prompts, failures
                )
        return grad, grad_prompts

    async def _backward_rerouted(
        self,
        start: int,
        end: int,
        record: SpanRecord,
        grad: Tensor,
        prompts: Tensor | None,
        grad_prompts: Tensor | None,
        failures: int,
    ) -> Tensor:
        """Backward over [start, end) on a fresh route, from the failed span's record: recompute the route's
        intermediate inputs, then go in reverse. Adds the prompts' gradients into grad_prompts; returns the gradient
        w.r.t. the record's inputs."""
        mask = record.mask
        while True:
            route = await self.manager.make_forward_route(start, end)
            span = route[0]
            try:
                inputs = [record.inputs]
                for span in route[:-1]:
                    inputs.append(await self.forward_span(span, inputs[-1], self._prompts_of(prompts, span), mask))
                g, pieces = grad, []
                for span, x in zip(reversed(route), reversed(inputs)):
                    g, span_grad = await self.backward_span(span, x, g, self._prompts_of(prompts, span), mask)
                    pieces.append((span, span_grad))
            except (PeerUnavailable, RemoteError) as e:
                failures = self.manager.after_failure(e, failures, span)
                await self.manager.backoff(failures)
                continue
            for span, span_grad in pieces:  # only once the whole route succeeded: a retry must not count twice
                self.manager.forgive(span.peer_id)
                self._accumulate(grad_prompts, span, span_grad)
            return g

    # ------------------------------------------------------------------ one request
    async def forward_span(
        self,
        span: Span,
        hidden: Tensor,
        prompts: Tensor | None,
        mask: Tensor | None = None,
        emulate: ComputeKind | None = None,
        codec: str | None = None,
    ) -> Tensor:
        """rpc_forward of hidden (b, T, H) over one span; prompts (span blocks, P, H) or None; mask (b, T) or None;
        `emulate`: computed as a server of that kind would (spot checks; server.compute.emulation); `codec`: how the hidden
        states travel both ways (default ClientConfig.compression)."""
        tensors = _with_extras({"hidden": hidden}, mask, prompts)
        request = ForwardRequest(
            protocol_version=PROTOCOL_VERSION,
            blocks=BlockRange(start=span.start, end=span.end),
            active_adapter=self.manager.config.active_adapter,
            emulate=emulate,
            codec=self.manager.config.compression if codec is None else codec,
        )
        reply, out = await self._call(span.peer_id, "forward", request, tensors)
        if not isinstance(reply, ForwardResult) or out["hidden"].shape != hidden.shape:
            raise PeerUnavailable(f"server {span.peer_id} sent a malformed forward result")
        return out["hidden"].to(hidden.dtype)

    async def backward_span(
        self, span: Span, hidden: Tensor, grad: Tensor, prompts: Tensor | None, mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """rpc_backward over one span: (grad w.r.t. hidden (b, T, H), grad w.r.t. prompts or None)."""
        tensors = _with_extras({"hidden": hidden, "grad_output": grad.to(hidden.dtype)}, mask, prompts)
        request = BackwardRequest(
            protocol_version=PROTOCOL_VERSION,
            blocks=BlockRange(start=span.start, end=span.end),
            active_adapter=self.manager.config.active_adapter,
            codec=self.manager.config.compression,
        )
        reply, out = await self._call(span.peer_id, "backward", request, tensors)
        grad_prompts = out.get("grad_prompts")
        if (
            not isinstance(reply, BackwardResult)
            or out["grad_hidden"].shape != hidden.shape
            or (
                (grad_prompts is None) != (prompts is None)
                or (prompts is not None and grad_prompts.shape != prompts.shape)
            )
        ):
            raise PeerUnavailable(f"server {span.peer_id} sent a malformed backward result")
        return out["grad_hidden"].to(hidden.dtype), (None if prompts is None else grad_prompts.to(prompts.dtype))

    async def _call(
        self, peer_id: str, verb: str, request: ForwardRequest | BackwardRequest, tensors: dict[str, Tensor]
    ):
        config = self.manager.config
        connection = await Connection.open(self.manager.node.p2p, peer_id, verb, self.manager.open_timeout(peer_id))
        try:
            await connection.send(request, tensors, request.codec)
            return await connection.receive(config.request_timeout)
        finally:
            connection.close()

    def _prompts_of(self, prompts: Tensor | None, span: Span) -> Tensor | None:
        return None if prompts is None else prompts[span.start - self.start : span.end - self.start]

    def _accumulate(self, total: Tensor | None, span: Span, grad: Tensor | None) -> None:
        if total is not None and grad is not None:
            total[span.start - self.start : span.end - self.start] += grad


def _with_extras(tensors: dict[str, Tensor], mask: Tensor | None, prompts: Tensor | None) -> dict[str, Tensor]:
    """`tensors` with the optional attention mask and deep prompts of a forward or backward request added."""
    if mask is not None:
        tensors["attention_mask"] = mask
    if prompts is not None:
        tensors["prompts"] = prompts
    return tensors


class RemoteBlocksFunction(torch.autograd.Function):
    """hidden (B, T, H), prompts (n_blocks, P, H) or None, mask (B, T) or None -> the blocks' output (B, T, H),
    differentiable in hidden and prompts."""

    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        prompts: Tensor | None,
        mask: Tensor | None,  # type: ignore[override]
        blocks: RemoteBlocks,
    ) -> Tensor:
        prompts = None if prompts is None else prompts.detach()
        output, chunks = run_sync(blocks.forward(hidden.detach(), prompts, mask))
        ctx.blocks, ctx.chunks, ctx.prompts = blocks, chunks, prompts
        return output

    @staticmethod
    def backward(ctx, grad_output: Tensor) -> tuple[Tensor, Tensor | None, None, None]:  # type: ignore[override]
        grad_hidden, grad_prompts = run_sync(ctx.blocks.backward(ctx.chunks, grad_output.contiguous(), ctx.prompts))
        return grad_hidden, grad_prompts, None, None

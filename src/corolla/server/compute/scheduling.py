"""Carrying out requests on the compute thread: each planned inference step, forward and backward pass.

Priorities (server.compute.worker): decode steps, padded and merged steps and the reordering of beams go first
(PRIORITY_INFERENCE), then the per-chunk, per-block pieces of long prefills (PRIORITY_LONG_INFERENCE), then
stateless forward and backward passes (PRIORITY_FORWARD). Every function runs with the request's LoRA adapter
active (`AdapterCalls.bind`, which gives one callable per function and adapter, so only steps of the same
adapter batch together).

`Scheduler` is the plain implementation of `Compute`, the interface the handler runs requests through; fault
injection (server.rpc.faults) wraps it without touching this path.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import torch
from torch import Tensor

from corolla.protocol.messages import ComputeKind, ErrorCode
from corolla.server.compute.adapter_calls import AdapterCalls
from corolla.server.compute.block_stack import BlockStack, DecodeItem
from corolla.server.compute.emulation import Emulator
from corolla.server.compute.worker import PRIORITY_FORWARD, PRIORITY_INFERENCE, PRIORITY_LONG_INFERENCE, ComputeWorker
from corolla.server.cache.kv import SessionKV
from corolla.server.compute.padding import padded_step
from corolla.server.compute.planner import ChunkRanges, Chunked, Decode, Merged, Padded, Plan, Step
from corolla.server.errors import RequestError


class Stepped(Protocol):
    """What a step needs of the session it runs in (server.rpc.sessions.ServerSession)."""

    cache: SessionKV  # the session's KV cache over its blocks
    adapter: str | None  # the LoRA adapter its steps run with


class Compute(Protocol):
    """What the handler runs checked requests through."""

    async def step(self, session: Stepped, step: Step, plan: Plan) -> Tensor:
        """The session's blocks' output (B, T, H) for `step`, run as `plan` says; the cache then holds the step."""
        ...

    async def forward(self, hidden: Tensor, start: int, end: int, adapter: str | None, prompts: Tensor | None,
                      mask: Tensor | None, kind: ComputeKind | None = None) -> Tensor:
        """A cache-less forward of hidden (B, T, H) through blocks [start, end); with `kind`, computed as a server of
        that kind would (server.compute.emulation; the caller checked that it can)."""
        ...

    async def backward(self, hidden: Tensor, grad_output: Tensor, start: int, end: int, adapter: str | None,
                       prompts: Tensor | None, mask: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """(grad w.r.t. hidden, grad w.r.t. prompts or None) of blocks [start, end)."""
        ...


class Scheduler:
    """Runs requests on one compute worker; a step taking more than `step_timeout` seconds raises TIMEOUT."""

    def __init__(self, stack: BlockStack, worker: ComputeWorker, adapters: AdapterCalls, step_timeout: float,
                 emulator: Emulator):
        self.stack = stack
        self.worker = worker
        self.adapters = adapters
        self.step_timeout = step_timeout
        self.emulator = emulator  # forwards computed as another kind of server (spot checks, server.compute.emulation)

    async def step(self, session: Stepped, step: Step, plan: Plan) -> Tensor:
        if step.hypo_ids is not None:  # beam search: rows follow their hypotheses before the step
            await self.worker.run(PRIORITY_INFERENCE, session.cache.reorder, step.hypo_ids, step.position)
        try:
            return await asyncio.wait_for(self._compute(session, step, plan), self.step_timeout)
        except asyncio.TimeoutError:
            raise RequestError(ErrorCode.TIMEOUT, f"step took more than {self.step_timeout:.0f}s") from None

    def _compute(self, session: Stepped, step: Step, plan: Plan):  # -> Awaitable[Tensor]
        bind, adapter, cache = self.adapters.bind, session.adapter, session.cache
        match plan:
            case Decode(key, lengths):
                return self.worker.run_batched(PRIORITY_INFERENCE, bind(self.stack.decode_batch, adapter), key,
                                               DecodeItem(step.hidden, cache, lengths))
            case Padded():
                return self.worker.run(PRIORITY_INFERENCE, bind(padded_step, adapter), self.stack, step.hidden, cache,
                                       plan, step.prompts)
            case Merged(chunks):
                return self.worker.run(PRIORITY_INFERENCE, bind(self.stack.inference_step, adapter), step.hidden,
                                       cache, step.position, step.prompts, chunks)
            case Chunked(chunks):
                return self.chunked(step.hidden, cache, step.position, chunks, adapter, step.prompts)
        raise TypeError(f"unknown plan {plan!r}")

    async def chunked(self, hidden: Tensor, cache: SessionKV, position: int, chunks: ChunkRanges,
                      adapter: str | None = None, prompts: Tensor | None = None) -> Tensor:
        """A long prefill as one compute task per chunk and block, at a lower priority than short steps: other
        sessions keep decoding while it runs. Same result as the merged `BlockStack.inference_step`."""
        block_step, outputs = self.adapters.bind(self.stack.block_step, adapter), []
        for offset, stop in chunks:
            part = hidden[:, offset:stop]  # (B, t, H)
            for index in range(cache.start, cache.end):
                part = await self.worker.run(PRIORITY_LONG_INFERENCE, block_step, part, cache, position + offset, index,
                                             prompts)
            outputs.append(part)
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)

    async def forward(self, hidden: Tensor, start: int, end: int, adapter: str | None, prompts: Tensor | None,
                      mask: Tensor | None, kind: ComputeKind | None = None) -> Tensor:
        if kind is not None and kind != self.emulator.own:
            return await self.worker.run(PRIORITY_FORWARD, self.emulator.forward, hidden, start, end, kind)
        forward = self.adapters.bind(self.stack.forward, adapter)
        return await self.worker.run(PRIORITY_FORWARD, forward, hidden, start, end, prompts, mask)

    async def backward(self, hidden: Tensor, grad_output: Tensor, start: int, end: int, adapter: str | None,
                       prompts: Tensor | None, mask: Tensor | None) -> tuple[Tensor, Tensor | None]:
        backward = self.adapters.bind(self.stack.backward, adapter)
        return await self.worker.run(PRIORITY_FORWARD, backward, hidden, grad_output, start, end, prompts, mask)


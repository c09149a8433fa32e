"""Benchmark: a server's own per-step overhead, in process, without any network.

One inference session is driven through `ConnectionHandler.rpc_inference` over in-memory streams: the client side
encodes each decode step as a frame and feeds it to the handler's reader; the handler decodes, checks, plans,
schedules the step on its compute thread and writes the answer frame, which the client side decodes. Beside it
the same single-token steps run straight through the blocks (`BlockStack.inference_step`, no handler). The
difference per step is what the server adds to the blocks' compute: framing, validation, planning, scheduling
and the hop to and from the compute thread.

    python bench/bench_step_overhead.py --steps 400 --repeats 5
Prints one JSON object on stdout (microseconds per step; medians over repeats of the per-run medians).
Works on protocol v1 and v2 trees alike, so that a change can be measured before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch
from transformers import LlamaConfig

from corolla.models.llama.block import LlamaBlock
from corolla.protocol import PROTOCOL_VERSION
from corolla.protocol.framing import decode_frame, encode_frame
from corolla.protocol.messages import BlockRange, CloseSession, InferenceStep, OpenSession
from corolla.server.compute.block_stack import BlockStack, KVLayout
from corolla.server.cache.allocator import CacheAllocator
from corolla.server.compute.worker import ComputeWorker
from corolla.server.config import ServerConfig
from corolla.server.rpc.handler import ConnectionHandler


def encode(message, tensors: dict[str, torch.Tensor]) -> bytes:
    payload = encode_frame(message, tensors if PROTOCOL_VERSION >= 2 else list(tensors.values()))
    return len(payload).to_bytes(8, "big") + payload


class MemoryWriter:
    """The handler's end of the stream back to the client: collects frames, wakes the reader on drain."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.ready = asyncio.Event()

    def write(self, data: bytes) -> None:
        self.buffer += data

    async def drain(self) -> None:
        self.ready.set()

    def close(self) -> None:
        pass

    async def next_frame(self):
        while True:
            if len(self.buffer) >= 8:
                length = int.from_bytes(self.buffer[:8], "big")
                if len(self.buffer) >= 8 + length:
                    payload = bytes(self.buffer[8 : 8 + length])
                    del self.buffer[: 8 + length]
                    return decode_frame(payload)
            self.ready.clear()
            await self.ready.wait()


def make_stack(hidden: int, blocks: int) -> BlockStack:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=blocks, vocab_size=16)
    layers = [LlamaBlock(config, i).eval().requires_grad_(False) for i in range(blocks)]
    return BlockStack(layers, 0, hidden, KVLayout(2, hidden // 4), torch.float32, torch.device("cpu"))


async def through_handler(stack: BlockStack, steps: int, prompt: int) -> list[float]:
    """Seconds per decode step, client frame in to client frame decoded, through rpc_inference."""
    worker = ComputeWorker()
    handler = ConnectionHandler(
        stack, CacheAllocator(1 << 16), worker, ServerConfig(model="unused"), describe=lambda: None
    )
    reader, writer = asyncio.StreamReader(), MemoryWriter()
    blocks = BlockRange(start=stack.start, end=stack.end)
    task = asyncio.ensure_future(handler.rpc_inference(reader, writer, "bench"))
    try:
        reader.feed_data(
            encode(OpenSession(protocol_version=PROTOCOL_VERSION, blocks=blocks, max_length=prompt + steps + 1), {})
        )
        await writer.next_frame()
        reader.feed_data(
            encode(InferenceStep(step_id=0, position=0), {"hidden": torch.randn(1, prompt, stack.hidden_size)})
        )
        await writer.next_frame()
        times = []
        for i in range(steps):
            x = torch.randn(1, 1, stack.hidden_size)
            begin = time.perf_counter()
            reader.feed_data(encode(InferenceStep(step_id=i + 1, position=prompt + i), {"hidden": x}))
            message, tensors = await writer.next_frame()
            times.append(time.perf_counter() - begin)
            assert message.kind == "step_result", message
        reader.feed_data(encode(CloseSession(), {}))
        await task
    finally:
        task.cancel()
        worker.shutdown()
    return times


def blocks_alone(stack: BlockStack, steps: int, prompt: int) -> list[float]:
    """Seconds per single-token step straight through the blocks, on this thread."""
    cache = stack.allocate_cache(1, prompt + steps + 1, stack.start, stack.end)
    extra = (stack.start, stack.end) if PROTOCOL_VERSION < 2 else ()  # v1 stacks took the block range on every call
    stack.inference_step(torch.randn(1, prompt, stack.hidden_size), cache, 0, *extra)
    times = []
    for i in range(steps):
        x = torch.randn(1, 1, stack.hidden_size)
        begin = time.perf_counter()
        stack.inference_step(x, cache, prompt + i, *extra)
        times.append(time.perf_counter() - begin)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    stack = make_stack(args.hidden, args.blocks)
    handler_runs, alone_runs = [], []
    for _ in range(args.repeats):  # interleaved, so that load on the machine hits both alike
        handler_runs.append(statistics.median(asyncio.run(through_handler(stack, args.steps, args.prompt))[20:]))
        alone_runs.append(statistics.median(blocks_alone(stack, args.steps, args.prompt)[20:]))
    handler_us, alone_us = statistics.median(handler_runs) * 1e6, statistics.median(alone_runs) * 1e6
    print(
        json.dumps(
            {
                "protocol_version": PROTOCOL_VERSION,
                "hidden": args.hidden,
                "blocks": args.blocks,
                "steps": args.steps,
                "repeats": args.repeats,
                "step_through_handler_us": round(handler_us, 1),
                "blocks_alone_us": round(alone_us, 1),
                "server_overhead_us": round(handler_us - alone_us, 1),
                "runs_handler_us": [round(t * 1e6, 1) for t in handler_runs],
                "runs_alone_us": [round(t * 1e6, 1) for t in alone_runs],
            }
        )
    )


if __name__ == "__main__":
    main()

"""Long prefills run block by block at a lower priority: same result as the merged step, and other sessions'
decode steps go first. In-process: real tiny Llama blocks, a real compute thread (the handler's scheduler), no
network."""

from __future__ import annotations

import asyncio
import threading

import torch
from transformers import LlamaConfig

from corolla.models.llama.block import LlamaBlock
from corolla.server.compute.block_stack import BlockStack, KVLayout
from corolla.server.cache.allocator import CacheAllocator
from corolla.server.compute.worker import PRIORITY_INFERENCE, ComputeWorker
from corolla.server.config import ServerConfig
from corolla.server.rpc.handler import ConnectionHandler

HIDDEN = 32


def make_handler(max_chunk_tokens: int) -> tuple[ConnectionHandler, ComputeWorker]:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=3, vocab_size=16)
    blocks = [LlamaBlock(config, i).eval() for i in range(3)]
    stack = BlockStack(blocks, 0, HIDDEN, KVLayout(2, 8), torch.float32, torch.device("cpu"), max_chunk_tokens)
    worker = ComputeWorker()
    handler = ConnectionHandler(stack, CacheAllocator(1024), worker, ServerConfig(model="unused"), describe=lambda: None)
    return handler, worker


def test_long_step_equals_the_merged_step_and_fills_the_same_cache():
    handler, worker = make_handler(max_chunk_tokens=10)  # 2 rows x 23 tokens: chunks of 5 tokens
    stack = handler.stack
    hidden = torch.randn(2, 23, HIDDEN)
    try:
        merged_cache = stack.allocate_cache(2, 32, 1, 3)
        merged = stack.inference_step(hidden, merged_cache, 0)
        cache = stack.allocate_cache(2, 32, 1, 3)
        pieces = asyncio.run(handler.compute.chunked(hidden, cache, 0, stack.chunks(2, 23)))
    finally:
        worker.shutdown()
    assert stack.chunks(2, 23) == ((0, 5), (5, 10), (10, 15), (15, 20), (20, 23))
    torch.testing.assert_close(pieces, merged, rtol=0, atol=1e-6)
    for (k, v), (mk, mv) in zip(cache.pairs(), merged_cache.pairs(), strict=True):
        torch.testing.assert_close(k, mk, rtol=0, atol=1e-6)
        torch.testing.assert_close(v, mv, rtol=0, atol=1e-6)


def test_decode_steps_queued_during_a_long_prefill_run_before_its_remaining_blocks():
    handler, worker = make_handler(max_chunk_tokens=2048)
    stack, order = handler.stack, []
    block_step = stack.block_step

    def recorded_block_step(part, cache, position, index, prompts=None):
        order.append(f"prefill block {index}")
        return block_step(part, cache, position, index, prompts)

    stack.block_step = recorded_block_step
    release = threading.Event()

    async def scenario():
        blocker = asyncio.ensure_future(worker.run(PRIORITY_INFERENCE, release.wait, 5.0))
        await asyncio.sleep(0.05)  # the compute thread is busy
        cache = stack.allocate_cache(1, 300, 0, 3)
        prefill = asyncio.ensure_future(handler.compute.chunked(torch.randn(1, 200, HIDDEN), cache, 0, stack.chunks(1, 200)))
        await asyncio.sleep(0.05)  # its first block is queued behind the blocker
        decode = asyncio.ensure_future(worker.run(PRIORITY_INFERENCE, order.append, "decode step"))
        await asyncio.sleep(0.05)  # queued too, after the prefill's first block
        release.set()
        await asyncio.gather(blocker, prefill, decode)

    try:
        asyncio.run(scenario())
    finally:
        worker.shutdown()
    assert order == ["decode step", "prefill block 0", "prefill block 1", "prefill block 2"]

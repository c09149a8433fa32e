"""The server's stream handlers in process: real tiny Llama blocks, a real compute thread, in-memory streams
instead of P2P ones. A session's steps (merged, decoded, rolled back) equal the blocks' own; errors reach the
client and free the cache; an armed `corrupt` fault scales half the output features by exactly 1.01; a v1 peer
gets a v1 error."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import msgpack
import pytest
import torch
from transformers import LlamaConfig

from corolla.models.llama.block import LlamaBlock
from corolla.protocol import PROTOCOL_VERSION
from corolla.protocol.framing import decode_frame, encode_frame
from corolla.protocol.messages import (
    BlockRange,
    CloseSession,
    ErrorReply,
    ForwardRequest,
    ForwardResult,
    InferenceStep,
    OpenSession,
    SessionOpened,
    StepResult,
)
from corolla.server.compute.block_stack import BlockStack, KVLayout
from corolla.server.cache.allocator import CacheAllocator
from corolla.server.compute.worker import ComputeWorker
from corolla.server.config import ServerConfig
from corolla.server.rpc.faults import CORRUPT_SCALE
from corolla.server.rpc.handler import ConnectionHandler, _legacy_stream, _stream_adapter
from corolla.server.metrics import ServerMetrics

HIDDEN = 32
PEER = SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: "test-peer"))


class MemoryWriter:
    def __init__(self) -> None:
        self.buffer = bytearray()
        self.ready = asyncio.Event()
        self.closed = False

    def write(self, data: bytes) -> None:
        self.buffer += data
        self.ready.set()

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    async def next_payload(self) -> bytes:
        while True:
            if len(self.buffer) >= 8 and len(self.buffer) >= 8 + (n := int.from_bytes(self.buffer[:8], "big")):
                payload = bytes(self.buffer[8 : 8 + n])
                del self.buffer[: 8 + n]
                return payload
            self.ready.clear()
            await asyncio.wait_for(self.ready.wait(), 30)


def framed(message, tensors=None) -> bytes:
    payload = encode_frame(message, tensors or {})
    return len(payload).to_bytes(8, "big") + payload


@pytest.fixture
def stack() -> BlockStack:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=3, vocab_size=16)
    blocks = [LlamaBlock(config, i).eval().requires_grad_(False) for i in range(3)]
    return BlockStack(blocks, 0, HIDDEN, KVLayout(2, 8), torch.float32, torch.device("cpu"))


def serve(stack: BlockStack, scenario, **config) -> object:
    """Run `scenario(handler, talk)` against a handler; talk(verb) -> (send, receive, task) of one new stream."""
    worker = ComputeWorker()
    allocator = CacheAllocator(1024)
    handler = ConnectionHandler(stack, allocator, worker, ServerConfig(model="unused", **config), describe=lambda: None)

    async def run():
        tasks, readers = [], []

        def talk(verb: str):
            reader, writer = asyncio.StreamReader(), MemoryWriter()
            readers.append(reader)
            tasks.append(asyncio.ensure_future(_stream_adapter(handler._handlers()[verb], verb, handler.metrics)(PEER, reader, writer)))

            async def receive():
                return decode_frame(await writer.next_payload())

            return reader.feed_data, receive

        try:
            return await scenario(handler, talk)
        finally:
            for reader in readers:  # the client closes its end: no stream waits out its linger for it
                reader.feed_eof()
            await asyncio.wait_for(asyncio.gather(*tasks), 30)

    try:
        result = asyncio.run(run())
    finally:
        worker.shutdown()
    assert allocator.budget.free == allocator.budget.total  # every session's cache was released
    return result


async def open_session(talk, batch_size: int = 1, max_length: int = 16):
    send, receive = talk("inference")
    send(framed(OpenSession(protocol_version=PROTOCOL_VERSION, blocks=BlockRange(start=0, end=3), max_length=max_length,
                            batch_size=batch_size)))
    reply, _ = await receive()
    assert isinstance(reply, SessionOpened)
    return send, receive


async def step(send, receive, hidden: torch.Tensor, position: int, step_id: int = 1) -> torch.Tensor:
    send(framed(InferenceStep(step_id=step_id, position=position), {"hidden": hidden}))
    reply, tensors = await receive()
    assert isinstance(reply, StepResult), reply
    assert (reply.step_id, reply.position) == (step_id, position + hidden.shape[1])
    return tensors["hidden"]


def test_session_steps_through_the_handler_equal_the_blocks_own_including_a_rollback(stack):
    torch.manual_seed(1)
    prompt, tokens = torch.randn(2, 5, HIDDEN), [torch.randn(2, 1, HIDDEN) for _ in range(4)]

    async def scenario(handler, talk):
        send, receive = await open_session(talk, batch_size=2)
        outputs = [await step(send, receive, prompt, 0)]  # merged
        for i, token in enumerate(tokens[:3]):
            outputs.append(await step(send, receive, token, 5 + i, step_id=2 + i))  # decode
        outputs.append(await step(send, receive, tokens[3], 6, step_id=9))  # rolled back: replaces position 6 on
        send(framed(CloseSession()))
        return outputs

    outputs = serve(stack, scenario)
    cache = stack.allocate_cache(2, 16, 0, 3)
    expected = [stack.inference_step(prompt, cache, 0)] + [stack.inference_step(t, cache, 5 + i) for i, t in enumerate(tokens[:3])]
    expected.append(stack.inference_step(tokens[3], cache, 6))
    for got, want in zip(outputs, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_a_bad_step_gets_an_error_naming_it_and_frees_the_session(stack):
    async def scenario(handler, talk):
        send, receive = await open_session(talk)
        send(framed(InferenceStep(step_id=1, position=0), {"hidden": torch.zeros(1, 2, HIDDEN),
                                                           "attention_mask": torch.zeros(1, 2)}))
        return await receive()

    reply, _ = serve(stack, scenario)
    assert isinstance(reply, ErrorReply) and reply.code == "bad_request"
    assert "attention_mask must be bool or integer, got torch.float32" in reply.message


def test_armed_corrupt_fault_scales_outputs_from_then_on(stack):
    torch.manual_seed(2)
    prompt, token, rows = torch.randn(1, 4, HIDDEN), torch.randn(1, 1, HIDDEN), torch.randn(2, 3, HIDDEN)

    async def forward(talk) -> torch.Tensor:
        send, receive = talk("forward")
        send(framed(ForwardRequest(protocol_version=PROTOCOL_VERSION, blocks=BlockRange(start=0, end=3)), {"hidden": rows}))
        reply, tensors = await receive()
        assert isinstance(reply, ForwardResult)
        return tensors["hidden"]

    async def scenario(handler, talk):
        send, receive = await open_session(talk)
        before = [await step(send, receive, prompt, 0), await forward(talk)]
        handler.arm_fault()
        after = [await step(send, receive, token, 4, step_id=2), await forward(talk)]
        send(framed(CloseSession()))
        return before, after

    (prefill, forward_before), (decoded, forward_after) = serve(stack, scenario, inject_fault="corrupt")
    cache = stack.allocate_cache(1, 16, 0, 3)
    torch.testing.assert_close(prefill, stack.inference_step(prompt, cache, 0), rtol=0, atol=1e-6)
    scale = torch.ones(HIDDEN)
    scale[: HIDDEN // 2] = CORRUPT_SCALE
    torch.testing.assert_close(decoded, stack.inference_step(token, cache, 4) * scale, rtol=0, atol=1e-6)
    torch.testing.assert_close(forward_before, stack.forward(rows, 0, 3), rtol=0, atol=1e-6)
    torch.testing.assert_close(forward_after, forward_before * scale, rtol=0, atol=1e-6)


def test_a_v1_request_on_a_v1_handler_name_gets_a_v1_error_naming_both_versions():
    v1_header = msgpack.packb({"msg": {"kind": "forward", "protocol_version": 1, "blocks": {"start": 0, "end": 1},
                                       "active_adapter": None}, "tensors": [["float32", [1, 2, 4]]]})
    v1_payload = len(v1_header).to_bytes(4, "big") + v1_header + bytes(32)

    async def scenario():
        reader, writer = asyncio.StreamReader(), MemoryWriter()
        reader.feed_data(len(v1_payload).to_bytes(8, "big") + v1_payload)
        reader.feed_eof()  # the client's end closed once it has sent its request: no linger waiting for it
        await _legacy_stream(1, "inference", ServerMetrics())(PEER, reader, writer)
        return await writer.next_payload(), writer.closed

    payload, closed = asyncio.run(scenario())
    header_len = int.from_bytes(payload[:4], "big")
    reply = msgpack.unpackb(payload[4 : 4 + header_len])
    assert reply["tensors"] == [] and reply["msg"]["kind"] == "error" and reply["msg"]["code"] == "bad_request"
    assert f"peer speaks corolla protocol v1, this side speaks v{PROTOCOL_VERSION}" in reply["msg"]["message"]
    assert closed


def test_a_step_older_than_the_last_one_run_is_refused(stack):
    """Steps of a session run in the order of their ids: a late one (a push overtaken by the owner's own retry)
    must not overwrite what the newer step wrote."""
    torch.manual_seed(2)
    prompt, token, late = torch.randn(1, 3, HIDDEN), torch.randn(1, 1, HIDDEN), torch.randn(1, 1, HIDDEN)

    async def scenario(handler, talk):
        send, receive = await open_session(talk)
        await step(send, receive, prompt, 0, step_id=4)
        await step(send, receive, token, 3, step_id=7)
        send(framed(InferenceStep(step_id=5, position=3), {"hidden": late}))
        return await receive()

    reply, _ = serve(stack, scenario)
    assert isinstance(reply, ErrorReply) and reply.code == "bad_request"
    assert "step 5 arrived after step 7" in reply.message

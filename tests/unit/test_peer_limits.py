"""Per-peer limits through the real handler over in-memory streams (as tests/unit/test_handler.py): streams, sessions,
forward/backward calls in flight and probes per peer, the size of one pass and of its frame, probe replies streamed
and dropped when their reader stalls. Every limit refuses only the peer past it: another peer gets in meanwhile."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig

from corolla.models.llama.block import LlamaBlock
from corolla.protocol import PROTOCOL_VERSION
from corolla.protocol.framing import decode_frame, encode_frame, write_frame
from corolla.protocol.messages import (
    BackwardRequest,
    BlockRange,
    CloseSession,
    ErrorReply,
    ForwardRequest,
    ForwardResult,
    OpenSession,
    ProbeReply,
    ProbeRequest,
    SessionOpened,
)
from corolla.server.compute.block_stack import BlockStack, KVLayout
from corolla.server.cache.allocator import CacheAllocator
from corolla.server.compute.worker import ComputeWorker
from corolla.server.config import ServerConfig, public_model_name
from corolla.server.rpc.handler import ConnectionHandler, _stream_adapter
from corolla.server.presence.network import PROBE_CHUNK_BYTES, probe_reply_head

HIDDEN = 32
BLOCKS = BlockRange(start=0, end=2)


class Transport:
    def __init__(self) -> None:
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True

    def get_write_buffer_size(self) -> int:
        return 0


class MemoryWriter:
    """A stream's server side writer; while `reading` is clear, drain() blocks, as with a peer that stopped reading."""

    def __init__(self, stalled: bool = False) -> None:
        self.buffer = bytearray()
        self.ready = asyncio.Event()
        self.reading = asyncio.Event()
        if not stalled:
            self.reading.set()
        self.transport = Transport()
        self.most_buffered = 0  # the most bytes ever written but not drained

    def write(self, data) -> None:
        self.buffer += data
        self.most_buffered = max(self.most_buffered, len(self.buffer))
        self.ready.set()

    async def drain(self) -> None:
        await self.reading.wait()

    def close(self) -> None:
        pass

    async def next_frame(self):
        while not (len(self.buffer) >= 8 and len(self.buffer) >= 8 + (n := int.from_bytes(self.buffer[:8], "big"))):
            self.ready.clear()
            await asyncio.wait_for(self.ready.wait(), 30)
        payload = bytes(self.buffer[8: 8 + n])
        del self.buffer[: 8 + n]
        return decode_frame(payload)


def framed(message, tensors=None) -> bytes:
    payload = encode_frame(message, tensors or {})
    return len(payload).to_bytes(8, "big") + payload


@pytest.fixture(scope="module")
def stack() -> BlockStack:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=16)
    blocks = [LlamaBlock(config, i).eval().requires_grad_(False) for i in range(2)]
    return BlockStack(blocks, 0, HIDDEN, KVLayout(2, 8), torch.float32, torch.device("cpu"))


class Stream:
    """One in-memory stream of `peer` into the guarded handler (as registered on a P2P node)."""

    def __init__(self, handler: ConnectionHandler, verb: str, peer: str, stalled: bool = False):
        self.reader, self.writer = asyncio.StreamReader(), MemoryWriter(stalled)
        info = SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: peer))
        on_stream = handler.peer_limits.guard(_stream_adapter(handler._handlers()[verb], verb, handler.metrics), verb,
                                              write_frame, handler.metrics.observe_error)
        self.task = asyncio.ensure_future(on_stream(info, self.reader, self.writer))

    def send(self, data: bytes) -> None:
        self.reader.feed_data(data)

    async def receive(self):
        return await self.writer.next_frame()

    def close(self) -> None:
        if not self.reader.at_eof():
            self.reader.feed_eof()


def serve(stack: BlockStack, scenario, cache_tokens: int = 1024, **config):
    """Run `scenario(handler, open_stream)`; open_stream(verb, peer, stalled=False) -> Stream. Afterwards every
    stream is closed, finished, and nothing is left counted or reserved."""
    worker = ComputeWorker()
    allocator = CacheAllocator(cache_tokens)
    handler = ConnectionHandler(stack, allocator, worker, ServerConfig(model="unused", **config), describe=lambda: None)

    async def run():
        streams: list[Stream] = []

        def open_stream(verb: str, peer: str, stalled: bool = False) -> Stream:
            streams.append(Stream(handler, verb, peer, stalled))
            return streams[-1]

        try:
            return await scenario(handler, open_stream)
        finally:
            for stream in streams:
                stream.close()
            await asyncio.wait_for(asyncio.gather(*(s.task for s in streams)), 30)

    try:
        result = asyncio.run(run())
    finally:
        worker.shutdown()
    assert allocator.budget.free == allocator.budget.total
    assert not handler.peer_limits.streams and not handler.peer_limits.probes and not handler.table.by_peer
    return result


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def forward_frame(batch: int, length: int) -> bytes:
    return framed(ForwardRequest(protocol_version=PROTOCOL_VERSION, blocks=BLOCKS), {"hidden": torch.randn(batch, length, HIDDEN)})


def open_frame(max_length: int = 8) -> bytes:
    return framed(OpenSession(protocol_version=PROTOCOL_VERSION, blocks=BLOCKS, max_length=max_length))


# ---------------------------------------------------------------- streams and sessions
def test_a_peer_past_its_stream_limit_is_refused_with_peer_limit_and_another_peer_gets_in(stack):
    async def scenario(handler, open_stream):
        held = [open_stream("forward", "greedy") for _ in range(3)]  # silent: each holds a stream
        await settle()
        extra = open_stream("forward", "greedy")
        refused, _ = await extra.receive()
        other = open_stream("forward", "honest")
        other.send(forward_frame(1, 2))
        answer, _ = await other.receive()
        counted = dict(handler.peer_limits.streams)
        held[0].send(forward_frame(1, 2))  # one of the three finishes: the peer may open one more
        assert isinstance((await held[0].receive())[0], ForwardResult)
        held[0].close()
        await held[0].task
        again = open_stream("forward", "greedy")
        again.send(forward_frame(1, 2))
        metric = handler.metrics.registry.get_sample_value("corolla_server_errors_total",
                                                           {"rpc": "forward", "code": "peer_limit"})
        return refused, answer, counted, (await again.receive())[0], metric

    refused, answer, counted, again, metric = serve(stack, scenario, max_peer_streams=3)
    assert metric == 1
    assert isinstance(refused, ErrorReply) and refused.code == "peer_limit", refused
    assert "3 streams open" in refused.message
    assert isinstance(answer, ForwardResult) and isinstance(again, ForwardResult)
    assert counted == {"greedy": 3, "honest": 1}


def test_a_peer_past_its_session_limit_gets_server_full_naming_it_and_another_peer_opens_one(stack):
    async def scenario(handler, open_stream):
        first = open_stream("inference", "p")
        first.send(open_frame())
        assert isinstance((await first.receive())[0], SessionOpened)
        second = open_stream("inference", "p")
        second.send(open_frame())
        refused, _ = await second.receive()
        other = open_stream("inference", "q")
        other.send(open_frame())
        opened, _ = await other.receive()
        for stream in (first, other):
            stream.send(framed(CloseSession()))
        return refused, opened

    refused, opened = serve(stack, scenario, max_peer_sessions=1)
    assert isinstance(refused, ErrorReply) and refused.code == "server_full" and "limit of 1 sessions" in refused.message
    assert isinstance(opened, SessionOpened)


# ---------------------------------------------------------------- forward / backward
def test_a_peers_passes_past_its_limit_wait_unread_while_another_peers_run(stack):
    async def scenario(handler, open_stream):
        holder = open_stream("forward", "p")  # silent: holds p's one slot until its frame comes
        await settle()
        queued = open_stream("forward", "p")
        queued.send(forward_frame(2, 3))
        other = open_stream("forward", "q")
        other.send(forward_frame(1, 2))
        assert isinstance((await other.receive())[0], ForwardResult)
        waiting = (queued.reader._buffer != b"", handler.peer_limits.passes_in_flight("p"), queued.writer.buffer == b"")
        holder.send(forward_frame(1, 1))
        assert isinstance((await holder.receive())[0], ForwardResult)
        return waiting, (await queued.receive())[0]

    waiting, answer = serve(stack, scenario, max_peer_passes=1)
    assert waiting == (True, 1, True)  # its frame unread, one call of p running, nothing answered yet
    assert isinstance(answer, ForwardResult)


def test_a_pass_over_more_tokens_than_the_limit_is_refused_before_computing(stack):
    async def scenario(handler, open_stream):
        stream = open_stream("forward", "p")
        stream.send(forward_frame(5, 4))  # 20 tokens, each row within the session limit
        return (await stream.receive())[0]

    reply = serve(stack, scenario, max_pass_tokens=16, max_session_length=8)
    assert isinstance(reply, ErrorReply) and reply.code == "bad_request"
    assert "5 x 4 = 20 tokens exceeds this server's limit of 16 tokens" in reply.message


@pytest.mark.parametrize("verb", ["forward", "backward"])
def test_a_pass_frame_larger_than_the_token_limit_allows_is_refused_unread(stack, verb):
    async def scenario(handler, open_stream):
        limit = handler.checks.pass_frame_limit(backward=verb == "backward")
        stream = open_stream(verb, "p")
        stream.send((limit + 1).to_bytes(8, "big"))  # announced, never sent: the server must not wait for it
        return limit, (await stream.receive())[0]

    limit, reply = serve(stack, scenario, max_pass_tokens=64, max_session_length=32)
    # float32 hidden states (and grad_output) of 64 tokens, deep prompts of 2 blocks x 32 positions, an int64 mask
    assert limit == ((2 if verb == "backward" else 1) * 64 + 2 * 32) * HIDDEN * 4 + 64 * 8 + 4 + (1 << 16)
    assert isinstance(reply, ErrorReply) and reply.code == "bad_request" and f"limit of {limit} bytes" in reply.message


def test_a_backward_within_the_limits_still_runs(stack):
    async def scenario(handler, open_stream):
        stream = open_stream("backward", "p")
        hidden = torch.randn(2, 8, HIDDEN)
        stream.send(framed(BackwardRequest(protocol_version=PROTOCOL_VERSION, blocks=BLOCKS),
                           {"hidden": hidden, "grad_output": torch.ones_like(hidden)}))
        return await stream.receive()

    reply, tensors = serve(stack, scenario, max_pass_tokens=16, max_session_length=8)
    assert reply.kind == "backward_result" and tensors["grad_hidden"].shape == (2, 8, HIDDEN)


# ---------------------------------------------------------------- probes
def test_a_probe_reply_is_written_in_chunks_and_decodes_as_one_frame(stack):
    async def scenario(handler, open_stream):
        stream = open_stream("probe", "p")
        stream.send(framed(ProbeRequest(reply_bytes=3 * PROBE_CHUNK_BYTES + 10), {"payload": torch.zeros(4, dtype=torch.int32)}))
        return await stream.receive(), stream.writer.most_buffered

    (reply, tensors), _ = serve(stack, scenario)
    assert isinstance(reply, ProbeReply) and tensors["payload"].shape == ((3 * PROBE_CHUNK_BYTES + 10) // 4,)
    assert not tensors["payload"].any()
    head = probe_reply_head(5)
    assert decode_frame(head[8:] + bytes(20))[1]["payload"].shape == (5,)
    assert int.from_bytes(head[:8], "big") == len(head) - 8 + 20


def test_a_stalled_probe_reader_is_dropped_and_its_peer_gets_one_probe_at_a_time(stack):
    async def scenario(handler, open_stream):
        stalled = open_stream("probe", "p", stalled=True)
        stalled.send(framed(ProbeRequest(reply_bytes=4 << 20), {"payload": torch.zeros(0, dtype=torch.int32)}))
        await settle()
        second = open_stream("probe", "p")
        second.send(framed(ProbeRequest(reply_bytes=8), {"payload": torch.zeros(0, dtype=torch.int32)}))
        refused, _ = await second.receive()
        other = open_stream("probe", "q")
        other.send(framed(ProbeRequest(reply_bytes=8), {"payload": torch.zeros(0, dtype=torch.int32)}))
        answered, _ = await other.receive()
        await asyncio.wait_for(stalled.task, 10)  # dropped after probe_stall_timeout
        return refused, answered, stalled.writer.transport.aborted, stalled.writer.most_buffered

    refused, answered, aborted, buffered = serve(stack, scenario, probe_stall_timeout=2.0)
    assert isinstance(refused, ErrorReply) and refused.code == "peer_limit" and "one at a time" in refused.message
    assert isinstance(answered, ProbeReply)
    assert aborted and buffered < PROBE_CHUNK_BYTES + 1024  # the header and one chunk, never the whole 4 MiB


def test_a_peers_probe_arriving_while_its_previous_one_ends_waits_for_it(stack):
    async def scenario(handler, open_stream):
        first = open_stream("probe", "p", stalled=True)
        first.send(framed(ProbeRequest(reply_bytes=1 << 20), {"payload": torch.zeros(0, dtype=torch.int32)}))
        await settle()
        second = open_stream("probe", "p")
        second.send(framed(ProbeRequest(reply_bytes=8), {"payload": torch.zeros(0, dtype=torch.int32)}))
        await asyncio.sleep(0.3)  # the first one's reader catches up within the second one's wait
        first.writer.reading.set()
        return (await first.receive())[0], (await second.receive())[0]

    first, second = serve(stack, scenario)
    assert isinstance(first, ProbeReply) and isinstance(second, ProbeReply)


def test_a_probe_larger_than_the_servers_limit_is_refused(stack):
    async def scenario(handler, open_stream):
        asks = open_stream("probe", "p")
        asks.send(framed(ProbeRequest(reply_bytes=(1 << 20) + 4), {"payload": torch.zeros(0, dtype=torch.int32)}))
        sends = open_stream("probe", "q")
        sends.send(framed(ProbeRequest(reply_bytes=0), {"payload": torch.zeros((1 << 18) + 1024 * 16 + 1, dtype=torch.int32)}))
        return (await asks.receive())[0], (await sends.receive())[0]

    asks, sends = serve(stack, scenario, max_probe_bytes=1 << 20)
    assert asks.code == "bad_request" and f"limit of {1 << 20} bytes" in asks.message
    assert sends.code == "bad_request" and "exceeds the limit" in sends.message


def test_probes_over_all_peers_are_capped(stack):
    async def scenario(handler, open_stream):
        _silent = [open_stream("probe", f"peer-{i}") for i in range(2)]  # each holds a probe until its frame comes
        await settle()
        third = open_stream("probe", "peer-2")
        return (await third.receive())[0], sorted(handler.peer_limits.probes)

    refused, running = serve(stack, scenario, max_probes=2)
    assert refused.code == "peer_limit" and "2 bandwidth probes at once" in refused.message
    assert running == ["peer-0", "peer-1"]


# ---------------------------------------------------------------- config
def test_the_model_is_named_to_peers_without_its_local_path(tmp_path):
    checkpoint = tmp_path / "ckpt" / "tiny-llama"
    checkpoint.mkdir(parents=True)
    assert public_model_name(str(checkpoint)) == "tiny-llama"
    assert public_model_name(str(checkpoint) + "/") == "tiny-llama"
    assert public_model_name("./models/x") == "x" and public_model_name("~/m/y") == "y"
    assert public_model_name("meta-llama/Llama-2-7b-hf") == "meta-llama/Llama-2-7b-hf"
    assert public_model_name("gpt2") == "gpt2"


@pytest.mark.parametrize("field, value", [("max_peer_cache_share", 0.0), ("max_peer_cache_share", 1.5),
                                          ("max_peer_streams", 0), ("max_pass_tokens", 0), ("probe_stall_timeout", 0.0)])
def test_limits_out_of_range_are_refused_when_the_config_is_built(field, value):
    with pytest.raises(ValueError, match=field):
        ServerConfig(model="m", **{field: value})


def test_one_row_of_a_whole_session_always_fits_in_a_pass(stack):
    async def scenario(handler, open_stream):
        stream = open_stream("forward", "p")
        stream.send(forward_frame(1, 24))  # 24 tokens > max_pass_tokens, but one row within max_session_length
        return (await stream.receive())[0], handler.checks.max_pass_tokens

    reply, limit = serve(stack, scenario, max_pass_tokens=16, max_session_length=32)
    assert isinstance(reply, ForwardResult) and limit == 32


def test_a_session_whose_requester_left_while_it_queued_gets_no_cache_allocated(stack):
    async def scenario(handler, open_stream):
        allocations = []
        allocate = handler.table.stack.allocate_cache
        handler.table.stack.allocate_cache = lambda *args: allocations.append(args) or allocate(*args)
        try:
            holder = open_stream("inference", "holder")
            holder.send(framed(OpenSession(protocol_version=PROTOCOL_VERSION, blocks=BLOCKS, max_length=1024)))
            assert isinstance((await holder.receive())[0], SessionOpened)  # the whole budget of 1024 tokens
            leaver = open_stream("inference", "leaver")
            leaver.send(framed(OpenSession(protocol_version=PROTOCOL_VERSION, blocks=BLOCKS, max_length=512,
                                           alloc_timeout=10.0)))
            await asyncio.sleep(0.2)  # queued behind the holder
            leaver.close()  # gone while it waits
            holder.send(framed(CloseSession()))  # its tokens go to the queued request...
            await asyncio.wait_for(leaver.task, 10)
            return len(allocations)
        finally:
            handler.table.stack.allocate_cache = allocate

    assert serve(stack, scenario) == 1  # ...which allocates nothing: only the holder's cache was ever allocated

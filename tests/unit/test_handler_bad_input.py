"""Bad input gets a clear error to that client only; the server frees its cache and keeps serving others. Peers of
another protocol version (hand-made v1 frames, on v1 and v2 stream names) get errors naming both versions.

The two servers of tests/swarm/test_bad_input.py's swarm (the tiny Llama's blocks 0:2 and 2:4, as `corolla serve`
loads them), in process: their real handlers, registered as on a P2P node (v1 stream names included), reached by
the client's own Connection over in-memory streams (memory_p2p). After each test every stream has ended, both caches
are wholly free and a new session on both servers still gives the blocks' own output. What needs real p2pd streams
or a real client (a stream cut mid-step, a handler name the server lacks, the client's own max_length check) stays
in tests/swarm/test_bad_input.py.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

import msgpack
import pytest
import torch
from hivemind.p2p import PeerID

from corolla.checkpoint import load_config
from corolla.client.swarm.connection import Connection
from corolla.client.event_loop import run_sync
from corolla.models import get_family
from corolla.protocol import PROTOCOL_VERSION, rpc_handler_name
from corolla.protocol.errors import RemoteError
from corolla.protocol.messages import (
    BlockRange,
    CloseSession,
    ForwardRequest,
    InferenceStep,
    OpenSession,
    SessionOpened,
    StepResult,
)
from corolla.protocol.signing import PeerKey
from corolla.server.compute.block_stack import BlockStack
from corolla.server.loading.blocks import load_stack
from corolla.server.cache.allocator import CacheAllocator
from corolla.server.compute.worker import ComputeWorker
from corolla.server.config import ServerConfig
from corolla.server.rpc.handler import ConnectionHandler
from memory_p2p import MemoryP2P

BOTH_VERSIONS = f"peer speaks corolla protocol v1, this side speaks v{PROTOCOL_VERSION}"
CACHE_TOKENS = 4096  # per server


@dataclass
class Server:
    """One in-process server: its blocks, cache and handler."""

    peer_id: str
    stack: BlockStack
    allocator: CacheAllocator
    worker: ComputeWorker
    handler: ConnectionHandler


@dataclass
class Servers:
    """Servers a (blocks 0:2) and b (2:4) on one in-memory P2P."""

    p2p: MemoryP2P
    a: str  # peer ids
    b: str
    by_peer: dict[str, Server]


def start_server(p2p: MemoryP2P, model_path: str, start: int, end: int) -> Server:
    """Blocks start:end of the checkpoint, loaded as `corolla serve --blocks start:end` loads them, behind a
    ConnectionHandler registered on `p2p` under a new peer id (on the client's event loop, as Connection uses it)."""
    config = ServerConfig(model=model_path, blocks=f"{start}:{end}", max_session_length=1024)
    model_config = load_config(model_path)
    stack, _ = load_stack(config, get_family(model_config), model_config, start, end, torch.float32, "float32",
                          torch.device("cpu"))
    peer_id = PeerKey.generate().peer_id
    allocator, worker = CacheAllocator(CACHE_TOKENS), ComputeWorker()
    handler = ConnectionHandler(stack, allocator, worker, config, describe=lambda: None)
    run_sync(handler.register(p2p.peer(peer_id)))
    return Server(peer_id, stack, allocator, worker, handler)


@pytest.fixture(scope="module")
def servers(tiny_llama_path) -> Servers:
    p2p = MemoryP2P(caller=PeerKey.generate().peer_id)
    a, b = start_server(p2p, tiny_llama_path, 0, 2), start_server(p2p, tiny_llama_path, 2, 4)
    try:
        yield Servers(p2p, a.peer_id, b.peer_id, {a.peer_id: a, b.peer_id: b})
    finally:
        for server in (a, b):
            server.worker.shutdown()


@pytest.fixture(autouse=True)
def others_are_unaffected_and_caches_are_freed(servers):
    """After each test: every stream it opened has ended, both caches are wholly free, and a new session through
    both servers gives the blocks' own output (the servers keep serving everyone else)."""
    yield
    run_sync(all_streams_ended(servers))
    for server in servers.by_peer.values():
        assert server.allocator.budget.free == server.allocator.budget.total, "the misbehaving session's cache was not freed"
    hidden = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(0))
    for peer in (servers.a, servers.b):
        connection = open_session(servers, peer, blocks=(0, 2) if peer == servers.a else (2, 4))
        try:
            reply, tensors = send_step(connection, hidden)
            assert isinstance(reply, StepResult)
            stack = servers.by_peer[peer].stack
            torch.testing.assert_close(tensors["hidden"], stack.forward(hidden, stack.start, stack.end), rtol=0, atol=1e-5)
            hidden = tensors["hidden"]
            run_sync(connection.send(CloseSession()))
        finally:
            connection.close()
    run_sync(all_streams_ended(servers))
    assert all(s.allocator.budget.free == s.allocator.budget.total for s in servers.by_peer.values())


async def all_streams_ended(servers: Servers) -> None:
    """Wait for the handler of every stream opened so far to return (a stream its client closed ends at once)."""
    streams = list(servers.p2p.streams)
    servers.p2p.streams.clear()
    done, pending = await asyncio.wait(streams, timeout=30) if streams else (set(), set())
    assert not pending, f"{len(pending)} streams still served 30 s after their test"
    for task in done:
        assert task.exception() is None, task.exception()  # the stream adapter lets nothing escape


def open_raw(servers: Servers, peer: str, verb: str = "inference") -> Connection:
    return run_sync(Connection.open(servers.p2p, peer, verb, timeout=10))


def exchange(connection: Connection, message, tensors=None):
    """Send one message on a raw stream and return the server's answer (ErrorReply raises RemoteError)."""

    async def go():
        await connection.send(message, tensors or {})
        return await connection.receive(10)

    return run_sync(go())


def open_session(servers: Servers, peer: str, blocks=(0, 2), max_length: int = 8) -> Connection:
    connection = open_raw(servers, peer)
    reply, _ = exchange(connection, OpenSession(protocol_version=PROTOCOL_VERSION, blocks=BlockRange(start=blocks[0], end=blocks[1]), max_length=max_length))
    assert isinstance(reply, SessionOpened)
    return connection


def send_step(connection: Connection, hidden: torch.Tensor, position: int = 0):
    return exchange(connection, InferenceStep(step_id=1, position=position), {"hidden": hidden})


def test_server_refuses_a_step_past_the_sessions_max_length(servers):
    connection = open_session(servers, servers.a, max_length=8)
    try:
        with pytest.raises(RemoteError, match="session_full.*max_length=8"):
            send_step(connection, torch.zeros(1, 12, 64))
    finally:
        connection.close()


def test_wrong_hidden_size_is_named_in_the_error(servers):
    connection = open_session(servers, servers.a)
    try:
        with pytest.raises(RemoteError, match=r"bad_request.*\(batch, length, 64\).*\(1, 1, 63\)"):
            send_step(connection, torch.zeros(1, 1, 63))
    finally:
        connection.close()


def test_wrong_dtype_is_named_in_the_error(servers):
    connection = open_session(servers, servers.a)
    try:
        with pytest.raises(RemoteError, match="bad_request.*torch.int64"):
            send_step(connection, torch.zeros(1, 1, 64, dtype=torch.int64))
    finally:
        connection.close()


def test_unknown_block_range_is_refused(servers):
    connection = open_raw(servers, servers.a)
    try:
        with pytest.raises(RemoteError, match=r"blocks 1:4 are not served here.*0:2"):
            exchange(connection, OpenSession(protocol_version=PROTOCOL_VERSION, blocks=BlockRange(start=1, end=4), max_length=8))
    finally:
        connection.close()


def test_forward_with_unknown_blocks_is_refused(servers):
    connection = open_raw(servers, servers.b, verb="forward")
    try:
        with pytest.raises(RemoteError, match="not served here"):
            exchange(connection, ForwardRequest(protocol_version=PROTOCOL_VERSION, blocks=BlockRange(start=0, end=3)),
                     {"hidden": torch.zeros(1, 2, 64)})
    finally:
        connection.close()


def test_garbage_bytes_get_a_protocol_error(servers):
    connection = open_raw(servers, servers.a)

    async def go():
        payload = os.urandom(64)
        connection.writer.write(len(payload).to_bytes(8, "big") + payload)
        await connection.writer.drain()
        return await connection.receive(10)

    try:
        with pytest.raises(RemoteError, match="bad_request"):
            run_sync(go())
    finally:
        connection.close()


def test_absurd_frame_length_is_refused_without_allocating(servers):
    connection = open_raw(servers, servers.a)

    async def go():
        connection.writer.write((1 << 62).to_bytes(8, "big"))
        await connection.writer.drain()
        return await connection.receive(10)

    try:
        with pytest.raises(RemoteError, match="exceeds the limit"):
            run_sync(go())
    finally:
        connection.close()


def test_step_from_a_future_position_is_refused(servers):
    connection = open_session(servers, servers.a)
    try:
        with pytest.raises(RemoteError, match="position 5, but the session holds only 0"):
            send_step(connection, torch.zeros(1, 1, 64), position=5)
    finally:
        connection.close()


@pytest.mark.parametrize("extras, error", [
    ({"prompts": torch.zeros(3, 2, 64)}, r"prompts must have shape \(2, P, 64\)"),  # one prompt per block of the span: 2
    ({"prompts": torch.zeros(2, 9, 64)}, "between 1 and the session's max_length 8"),
    ({"prompts": torch.full((2, 2, 64), float("nan"))}, "NaN"),
    ({"attention_mask": torch.tensor([[False, True, True]]), "prompts": torch.zeros(2, 2, 64)},
     "first 2 slots of every row must be real"),
    ({"attention_mask": torch.ones(1, 3)}, "attention_mask must be bool or integer, got torch.float32"),  # v1 took it for prompts
    ({"attention_mask": torch.ones(1, 2, dtype=torch.bool)}, r"attention_mask must have shape \(1, 3\)"),
])
def test_bad_masks_and_deep_prompts_on_an_inference_step_are_named(servers, extras, error):
    connection = open_session(servers, servers.a)
    try:
        with pytest.raises(RemoteError, match=f"bad_request.*{error}"):
            exchange(connection, InferenceStep(step_id=1, position=0), {"hidden": torch.zeros(1, 3, 64), **extras})
    finally:
        connection.close()


def write_raw(connection: Connection, header: dict, data: bytes = b"", legacy: bool = False):
    """Send a hand-made frame (msgpack header, then raw tensor bytes) and return the raw answer frame's header."""
    packed = msgpack.packb(header)
    payload = len(packed).to_bytes(4, "big") + packed + data

    async def go():
        connection.writer.write(len(payload).to_bytes(8, "big") + payload)
        await connection.writer.drain()
        length = int.from_bytes(await asyncio.wait_for(connection.reader.readexactly(8), 10), "big")
        answer = await connection.reader.readexactly(length)
        return msgpack.unpackb(answer[4 : 4 + int.from_bytes(answer[:4], "big")])

    return run_sync(go())


@pytest.mark.parametrize("names, error", [
    (["hidden", "prompts", "prompts"], "inference_step carries tensor 'prompts' twice"),
    (["hidden", "grad_output"], "inference_step carries no tensor 'grad_output'; its tensors: hidden, attention_mask"),
    (["prompts"], "inference_step needs tensor 'hidden'"),
])
def test_unknown_repeated_or_missing_tensor_names_are_refused(servers, names, error):
    connection = open_session(servers, servers.a)
    try:
        header = {"v": PROTOCOL_VERSION, "msg": {"kind": "inference_step", "step_id": 1, "position": 0},
                  "tensors": [[name, "float32", [1, 1, 64]] for name in names]}
        reply = write_raw(connection, header, bytes(256 * len(names)))["msg"]
        assert reply["kind"] == "error" and reply["code"] == "bad_request" and error in reply["message"]
    finally:
        connection.close()


def test_an_older_protocol_version_in_a_request_is_named_with_ours(servers):
    model, peer = servers, servers.a
    connection = open_raw(model, peer)
    try:
        with pytest.raises(RemoteError, match=f"bad_request.*{BOTH_VERSIONS}"):
            exchange(connection, OpenSession(protocol_version=1, blocks=BlockRange(start=0, end=2), max_length=8))
    finally:
        connection.close()
    connection = open_raw(model, peer, verb="forward")
    try:
        with pytest.raises(RemoteError, match=f"bad_request.*{BOTH_VERSIONS}"):
            exchange(connection, ForwardRequest(protocol_version=1, blocks=BlockRange(start=0, end=2)),
                     {"hidden": torch.zeros(1, 2, 64)})
    finally:
        connection.close()


V1_OPEN = {"msg": {"kind": "open_session", "protocol_version": 1, "blocks": {"start": 0, "end": 2}, "max_length": 8,
                   "batch_size": 1, "alloc_timeout": 0.0, "active_adapter": None}, "tensors": []}
V1_FORWARD = {"msg": {"kind": "forward", "protocol_version": 1, "blocks": {"start": 0, "end": 2}, "active_adapter": None},
              "tensors": [["float32", [1, 2, 64]]]}  # v1: tensors unnamed, told apart by dtype


@pytest.mark.parametrize("verb, header, data", [
    ("inference", V1_OPEN, b""), ("forward", V1_FORWARD, bytes(4 * 128)), ("info", {"msg": {"kind": "info"}, "tensors": []}, b""),
])
def test_a_v1_client_dialing_its_v1_stream_names_gets_a_v1_error_naming_both_versions(servers, verb, header, data):
    """What an old client sees: it dials corolla/v1/rpc_<verb>, sends a v1 frame, and reads a v1 error frame."""

    async def dial():
        _, reader, writer = await servers.p2p.call_binary_stream_handler(
            PeerID.from_base58(servers.a), rpc_handler_name(verb, version=1))
        return Connection(servers.a, reader, writer)

    connection = run_sync(dial())
    try:
        reply = write_raw(connection, header, data)
        assert reply["tensors"] == [] and set(reply) == {"msg", "tensors"}  # the v1 header layout, no version field
        assert reply["msg"]["kind"] == "error" and reply["msg"]["code"] == "bad_request"
        assert BOTH_VERSIONS in reply["msg"]["message"]
    finally:
        connection.close()


def test_a_v1_frame_on_a_current_stream_name_is_refused_naming_both_versions(servers):
    connection = open_raw(servers, servers.a)
    try:
        reply = write_raw(connection, V1_OPEN)["msg"]
        assert reply["code"] == "bad_request" and BOTH_VERSIONS in reply["message"]
    finally:
        connection.close()

"""Bad input gets a clear error to that client only; the server frees its cache and keeps serving others.
Peers of another protocol version (hand-made v1 frames, on v1 and v2 stream names) get errors naming both versions."""

from __future__ import annotations

import asyncio
import os

import msgpack
import pytest
import torch
from hivemind.p2p import PeerID
from transformers import LlamaForCausalLM

from corolla import AutoDistributedModelForCausalLM
from corolla.client.connection import Connection
from corolla.client.event_loop import run_sync
from corolla.protocol import PROTOCOL_VERSION, rpc_handler_name
from corolla.protocol.errors import PeerUnreachable, RemoteError
from corolla.protocol.messages import BlockRange, ForwardRequest, InferenceStep, OpenSession, SessionOpened

BOTH_VERSIONS = f"peer speaks corolla protocol v1, this side speaks v{PROTOCOL_VERSION}"


@pytest.fixture(scope="module")
def clients(llama_swarm):
    """Two independent clients (separate DHT nodes) of the same swarm."""
    models = [
        AutoDistributedModelForCausalLM.from_pretrained(llama_swarm.model_path, initial_peers=llama_swarm.initial_peers)
        for _ in range(2)
    ]
    yield models
    for m in models:
        m.shutdown()


@pytest.fixture(scope="module")
def reference(llama_swarm):
    return LlamaForCausalLM.from_pretrained(llama_swarm.model_path, dtype=torch.float32).eval()


@pytest.fixture(autouse=True)
def other_client_is_unaffected(clients, reference, llama_swarm):
    """After each test the other client still gets HF's output; then (conftest's shared_swarms_are_left_clean) the
    misbehaving session's cache is free and both servers are alive."""
    yield
    ids = torch.tensor([[1, 4, 9, 16]])
    assert torch.equal(clients[1].generate(ids, max_new_tokens=5), reference.generate(ids, max_new_tokens=5, do_sample=False))


def open_raw(model, peer: str, verb: str = "inference") -> Connection:
    return run_sync(Connection.open(model.swarm_node.p2p, peer, verb, timeout=10))


def exchange(connection: Connection, message, tensors=None):
    """Send one message on a raw stream and return the server's answer (ErrorReply raises RemoteError)."""

    async def go():
        await connection.send(message, tensors or {})
        return await connection.receive(10)

    return run_sync(go())


def open_session(model, peer: str, blocks=(0, 2), max_length: int = 8) -> Connection:
    connection = open_raw(model, peer)
    reply, _ = exchange(connection, OpenSession(protocol_version=PROTOCOL_VERSION, blocks=BlockRange(start=blocks[0], end=blocks[1]), max_length=max_length))
    assert isinstance(reply, SessionOpened)
    return connection


def send_step(connection: Connection, hidden: torch.Tensor, position: int = 0):
    return exchange(connection, InferenceStep(step_id=1, position=position), {"hidden": hidden})


def test_prompt_longer_than_max_length_fails_on_the_client_before_sending(clients):
    model = clients[0]
    with model.inference_session(max_length=8) as session:
        with pytest.raises(ValueError, match="max_length=8"):
            model.generate(torch.ones(1, 12, dtype=torch.long), max_new_tokens=2, session=session)


def test_server_refuses_a_step_past_the_sessions_max_length(clients, llama_swarm):
    connection = open_session(clients[0], llama_swarm.server_peer_ids[0], max_length=8)
    try:
        with pytest.raises(RemoteError, match="session_full.*max_length=8"):
            send_step(connection, torch.zeros(1, 12, 64))
    finally:
        connection.close()


def test_wrong_hidden_size_is_named_in_the_error(clients, llama_swarm):
    connection = open_session(clients[0], llama_swarm.server_peer_ids[0])
    try:
        with pytest.raises(RemoteError, match=r"bad_request.*\(batch, length, 64\).*\(1, 1, 63\)"):
            send_step(connection, torch.zeros(1, 1, 63))
    finally:
        connection.close()


def test_wrong_dtype_is_named_in_the_error(clients, llama_swarm):
    connection = open_session(clients[0], llama_swarm.server_peer_ids[0])
    try:
        with pytest.raises(RemoteError, match="bad_request.*torch.int64"):
            send_step(connection, torch.zeros(1, 1, 64, dtype=torch.int64))
    finally:
        connection.close()


def test_unknown_block_range_is_refused(clients, llama_swarm):
    connection = open_raw(clients[0], llama_swarm.server_peer_ids[0])
    try:
        with pytest.raises(RemoteError, match=r"blocks 1:4 are not served here.*0:2"):
            exchange(connection, OpenSession(protocol_version=PROTOCOL_VERSION, blocks=BlockRange(start=1, end=4), max_length=8))
    finally:
        connection.close()


def test_forward_with_unknown_blocks_is_refused(clients, llama_swarm):
    connection = open_raw(clients[0], llama_swarm.server_peer_ids[1], verb="forward")
    try:
        with pytest.raises(RemoteError, match="not served here"):
            exchange(connection, ForwardRequest(protocol_version=PROTOCOL_VERSION, blocks=BlockRange(start=0, end=3)),
                     {"hidden": torch.zeros(1, 2, 64)})
    finally:
        connection.close()


def test_garbage_bytes_get_a_protocol_error(clients, llama_swarm):
    connection = open_raw(clients[0], llama_swarm.server_peer_ids[0])

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


def test_absurd_frame_length_is_refused_without_allocating(clients, llama_swarm):
    connection = open_raw(clients[0], llama_swarm.server_peer_ids[0])

    async def go():
        connection.writer.write((1 << 62).to_bytes(8, "big"))
        await connection.writer.drain()
        return await connection.receive(10)

    try:
        with pytest.raises(RemoteError, match="exceeds the limit"):
            run_sync(go())
    finally:
        connection.close()


def test_stream_closed_mid_step_frees_the_session(clients, llama_swarm):
    connection = open_session(clients[0], llama_swarm.server_peer_ids[0], max_length=64)
    send_step(connection, torch.zeros(1, 3, 64))

    async def half_a_frame():
        connection.writer.write((10_000).to_bytes(8, "big") + b"\x00" * 100)
        await connection.writer.drain()
        await asyncio.sleep(0.1)

    run_sync(half_a_frame())
    connection.close()  # conftest's shared_swarms_are_left_clean checks that the server freed the cache


def test_step_from_a_future_position_is_refused(clients, llama_swarm):
    connection = open_session(clients[0], llama_swarm.server_peer_ids[0])
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
def test_bad_masks_and_deep_prompts_on_an_inference_step_are_named(clients, llama_swarm, extras, error):
    connection = open_session(clients[0], llama_swarm.server_peer_ids[0])
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
def test_unknown_repeated_or_missing_tensor_names_are_refused(clients, llama_swarm, names, error):
    connection = open_session(clients[0], llama_swarm.server_peer_ids[0])
    try:
        header = {"v": PROTOCOL_VERSION, "msg": {"kind": "inference_step", "step_id": 1, "position": 0},
                  "tensors": [[name, "float32", [1, 1, 64]] for name in names]}
        reply = write_raw(connection, header, bytes(256 * len(names)))["msg"]
        assert reply["kind"] == "error" and reply["code"] == "bad_request" and error in reply["message"]
    finally:
        connection.close()


def test_an_older_protocol_version_in_a_request_is_named_with_ours(clients, llama_swarm):
    model, peer = clients[0], llama_swarm.server_peer_ids[0]
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
def test_a_v1_client_dialing_its_v1_stream_names_gets_a_v1_error_naming_both_versions(clients, llama_swarm, verb, header, data):
    """What an old client sees: it dials corolla/v1/rpc_<verb>, sends a v1 frame, and reads a v1 error frame."""
    model = clients[0]

    async def dial():
        _, reader, writer = await model.swarm_node.p2p.call_binary_stream_handler(
            PeerID.from_base58(llama_swarm.server_peer_ids[0]), rpc_handler_name(verb, version=1))
        return Connection(llama_swarm.server_peer_ids[0], reader, writer)

    connection = run_sync(dial())
    try:
        reply = write_raw(connection, header, data)
        assert reply["tensors"] == [] and set(reply) == {"msg", "tensors"}  # the v1 header layout, no version field
        assert reply["msg"]["kind"] == "error" and reply["msg"]["code"] == "bad_request"
        assert BOTH_VERSIONS in reply["msg"]["message"]
    finally:
        connection.close()


def test_a_v1_frame_on_a_current_stream_name_is_refused_naming_both_versions(clients, llama_swarm):
    connection = open_raw(clients[0], llama_swarm.server_peer_ids[0])
    try:
        reply = write_raw(connection, V1_OPEN)["msg"]
        assert reply["code"] == "bad_request" and BOTH_VERSIONS in reply["message"]
    finally:
        connection.close()


def test_a_stream_the_server_has_no_handler_for_is_named_as_another_protocol(clients, llama_swarm):
    """What this client sees against a server of another protocol that lacks our stream names (e.g. an old v1 one)."""
    with pytest.raises(PeerUnreachable, match=f"does not speak corolla protocol v{PROTOCOL_VERSION}.*corolla/v{PROTOCOL_VERSION}/rpc_nothing"):
        open_raw(clients[0], llama_swarm.server_peer_ids[0], verb="nothing")

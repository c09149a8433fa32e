"""Bad input gets a clear error to that client only; the server frees its cache and keeps serving others."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
from transformers import LlamaForCausalLM

from conftest import wait_until
from corolla import AutoDistributedModelForCausalLM
from corolla.client.connection import Connection
from corolla.client.event_loop import run_sync
from corolla.client.server_info import request_info
from corolla.protocol import PROTOCOL_VERSION
from corolla.protocol.errors import RemoteError
from corolla.protocol.messages import BlockRange, ForwardRequest, InferenceStep, OpenSession, SessionOpened


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
def other_client_is_unaffected_and_caches_are_freed(clients, reference, llama_swarm):
    yield
    ids = torch.tensor([[1, 4, 9, 16]])
    assert torch.equal(clients[1].generate(ids, max_new_tokens=5), reference.generate(ids, max_new_tokens=5, do_sample=False))

    def free() -> bool:
        infos = [run_sync(request_info(clients[1]._node.p2p, p)).info for p in llama_swarm.server_peer_ids]
        return all(i.cache_tokens_free == i.cache_tokens_total for i in infos)

    assert wait_until(free, timeout=10), "the misbehaving session's cache was not freed"
    for proc in llama_swarm.local.processes:
        assert proc.alive(), f"{proc.name} died:\n{proc.tail()}"


def open_raw(model, peer: str, verb: str = "inference") -> Connection:
    return run_sync(Connection.open(model._node.p2p, peer, verb, timeout=10))


def exchange(connection: Connection, message, tensors=()):
    """Send one message on a raw stream and return the server's answer (ErrorReply raises RemoteError)."""

    async def go():
        await connection.send(message, tensors)
        return await connection.receive(10)

    return run_sync(go())


def open_session(model, peer: str, blocks=(0, 2), max_length: int = 8) -> Connection:
    connection = open_raw(model, peer)
    reply, _ = exchange(connection, OpenSession(protocol_version=PROTOCOL_VERSION, blocks=BlockRange(start=blocks[0], end=blocks[1]), max_length=max_length))
    assert isinstance(reply, SessionOpened)
    return connection


def send_step(connection: Connection, hidden: torch.Tensor, position: int = 0):
    return exchange(connection, InferenceStep(step_id=1, position=position), [hidden])


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
            exchange(connection, ForwardRequest(protocol_version=PROTOCOL_VERSION, blocks=BlockRange(start=0, end=3)), [torch.zeros(1, 2, 64)])
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
    connection.close()  # the autouse fixture checks that the server freed the cache


def test_step_from_a_future_position_is_refused(clients, llama_swarm):
    connection = open_session(clients[0], llama_swarm.server_peer_ids[0])
    try:
        with pytest.raises(RemoteError, match="position 5, but the session holds only 0"):
            send_step(connection, torch.zeros(1, 1, 64), position=5)
    finally:
        connection.close()


@pytest.mark.parametrize("extras, error", [
    ([torch.zeros(3, 2, 64)], r"prompts must have shape \(2, P, 64\)"),  # one prompt per block of the span: 2
    ([torch.zeros(2, 9, 64)], "between 1 and the session's max_length 8"),
    ([torch.full((2, 2, 64), float("nan"))], "NaN"),
    ([torch.zeros(2, 2, 64), torch.zeros(2, 2, 64)], "at most one attention mask and one prompts tensor"),
    ([torch.tensor([[False, True, True]]), torch.zeros(2, 2, 64)], "first 2 slots of every row must be real"),
])
def test_bad_deep_prompts_on_an_inference_step_are_named(clients, llama_swarm, extras, error):
    connection = open_session(clients[0], llama_swarm.server_peer_ids[0])
    try:
        with pytest.raises(RemoteError, match=f"bad_request.*{error}"):
            exchange(connection, InferenceStep(step_id=1, position=0), [torch.zeros(1, 3, 64), *extras])
    finally:
        connection.close()

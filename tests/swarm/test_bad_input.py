"""Bad input over real P2P streams: what needs the real client or p2pd rather than just a server's handlers (those
are tests/unit/test_handler_bad_input.py, in process): the client's own max_length check, a stream cut mid-step
(the server frees the session), a stream name the server has no handler for. After each test the other client
still gets HF's output, and the shared swarm's caches are free."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import LlamaForCausalLM

from conftest import PROBE, wait_until
from corolla import AutoDistributedModelForCausalLM
from corolla.client.swarm.connection import Connection
from corolla.client.event_loop import run_sync
from corolla.protocol import PROTOCOL_VERSION
from corolla.protocol.errors import PeerUnreachable
from corolla.protocol.messages import BlockRange, InferenceStep, OpenSession, SessionOpened


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


def test_stream_closed_mid_step_frees_the_session(clients, llama_swarm):
    """The session holds its cache (64 tokens: one row of max_length 64 over the server's two blocks) until its
    stream is cut in the middle of a frame; then the server frees it, and keeps serving (the autouse fixture)."""
    server = llama_swarm.procs["server-a"]
    connection = open_session(clients[0], server.peer_id, max_length=64)
    send_step(connection, torch.zeros(1, 3, 64))
    held = PROBE.info(server)
    assert (held.active_sessions, held.info.cache_tokens_total - held.info.cache_tokens_free) == (1, 64)

    async def half_a_frame():
        connection.writer.write((10_000).to_bytes(8, "big") + b"\x00" * 100)
        await connection.writer.drain()
        await asyncio.sleep(0.1)

    run_sync(half_a_frame())
    connection.close()

    def freed() -> bool:
        reply = PROBE.info(server)
        return reply.active_sessions == 0 and reply.info.cache_tokens_free == reply.info.cache_tokens_total

    assert wait_until(freed, timeout=20, interval=0.2), f"the cut session still holds its cache: {PROBE.info(server)}"


def test_a_stream_the_server_has_no_handler_for_is_named_as_another_protocol(clients, llama_swarm):
    """What this client sees against a server of another protocol that lacks our stream names (e.g. an old v1 one)."""
    with pytest.raises(PeerUnreachable, match=f"does not speak corolla protocol v{PROTOCOL_VERSION}.*corolla/v{PROTOCOL_VERSION}/rpc_nothing"):
        open_raw(clients[0], llama_swarm.server_peer_ids[0], verb="nothing")

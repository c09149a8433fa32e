"""A hostile peer of the swarm (corolla.testing.dht_attacks: a real DHT node that stores whatever it likes and sends
hand-made records to every peer) attacks other peers' DHT records; every attack fails, and new clients keep
generating. The victim is a real `corolla serve` process, or (private swarms, replays) a DHT node of the test that
announces like a server does."""

from __future__ import annotations

import asyncio

import pytest
import torch

from conftest import SERVER_ARGS, TestSwarm, start_named_servers
from corolla import AutoDistributedModelForCausalLM
from corolla.dht import ModelRecord, announce_blocks, create_swarm_node, model_dht_prefix
from corolla.membership import SwarmKey
from corolla.protocol import PROTOCOL_VERSION
from corolla.protocol.messages import ServerInfo, ServerState
from corolla.testing import dht_attacks


@pytest.fixture(scope="module")
def swarm(tiny_llama_path, tmp_path_factory):
    """A DHT peer and one server of all 4 blocks of the tiny Llama."""
    log_path = tmp_path_factory.mktemp("logs") / "dht-attacks.log"
    with open(log_path, "w") as log, TestSwarm(log_file=log, env={"COROLLA_CACHE": str(tmp_path_factory.mktemp("cache"))}) as local:
        named = start_named_servers(local, tiny_llama_path, {"victim": ["--blocks", "0:4"]})
        yield named


def generates(swarm) -> bool:
    """A new client generates through the swarm (MissingBlocks if it finds no server)."""
    model = AutoDistributedModelForCausalLM.from_pretrained(swarm.model_path, initial_peers=swarm.peers,
                                                            torch_dtype=torch.float32)
    try:
        out = model.generate(torch.tensor([[1, 5, 9]]), max_new_tokens=3)
    finally:
        model.shutdown()
    return out.shape == (1, 6)


def test_no_peer_can_hijack_a_live_servers_record(swarm):
    prefix, victim = model_dht_prefix(swarm.model_path), swarm.peer_ids["victim"]
    result = asyncio.run(dht_attacks.hijack_record(swarm.peers, prefix, 1, victim))
    assert not result.succeeded, result.details
    assert "dht.store -> False" in result.details and "accepted by peers: 0" in result.details, result.details
    assert generates(swarm)


def test_a_plain_value_cannot_squat_a_block_key(swarm):
    result = asyncio.run(dht_attacks.squat_key(swarm.peers, model_dht_prefix(swarm.model_path), 2))
    assert not result.succeeded, result.details
    assert "accepted by peers: 0" in result.details
    assert generates(swarm)


def test_an_answer_claiming_an_infinite_expiration_cannot_hide_a_record(swarm):
    prefix, victim = model_dht_prefix(swarm.model_path), swarm.peer_ids["victim"]
    result = asyncio.run(dht_attacks.shadow_key(swarm.peers, prefix, 0, victim, reads=6))
    assert not result.succeeded, result.details


@pytest.mark.parametrize("entries", [64, pytest.param(10_000, marks=pytest.mark.slow)])
def test_a_flooded_model_index_keeps_the_monitor_refreshing_on_schedule(swarm, entries):
    window = 3.0 if entries <= 64 else 6.0  # 6 refreshes a window before the flood at the least
    result = asyncio.run(dht_attacks.flood_model_index(swarm.peers, entries, refresh_period=0.5, window=window))
    assert not result.succeeded, result.details
    assert f"the real ones: ('{model_dht_prefix(swarm.model_path)}',)" in result.details, result.details
    assert " 0 fake model(s) shown" in result.details  # each claims 4096 blocks: more than a refresh reads


def test_256_sybils_filling_block_keys_first_cannot_keep_a_new_server_out(swarm):
    """Attack 3: one peer stores 256 fresh identities' valid server records under blocks 1 and 2 on every storing node;
    a server of 1:3 started afterwards is found under both within one announce period (5 s here) of being ready."""
    def start() -> str:
        proc = swarm.local.start_server(swarm.model_path, ["--blocks", "1:3", *SERVER_ARGS], name="sybil-newcomer")
        return proc.peer_id

    async def start_server() -> str:
        return await asyncio.to_thread(start)

    result = asyncio.run(dht_attacks.sybil_fill_block_keys(swarm.peers, model_dht_prefix(swarm.model_path), [1, 2],
                                                           start_server, wait=5.0))
    assert not result.succeeded, result.details
    assert "0 accepted by peers" in result.details, result.details


def test_255_sybils_claiming_a_real_models_prefix_cannot_hide_it_from_the_monitor(swarm):
    """Attack 4: 255 fresh identities' index entries claim the real model's prefix with 4,096 blocks."""
    result = asyncio.run(dht_attacks.sybil_model_claims(swarm.peers, model_dht_prefix(swarm.model_path), 4))
    assert not result.succeeded, result.details
    assert "0 accepted by peers" in result.details and "4 blocks, healthy=True" in result.details, result.details


def test_block_keys_full_of_the_largest_records_cannot_hide_a_server(swarm):
    """Last on this swarm: its block keys stay full of junk records (as many as honest nodes keep per key)."""
    prefix, victim = model_dht_prefix(swarm.model_path), swarm.peer_ids["victim"]
    result = asyncio.run(dht_attacks.flood_block_keys(swarm.peers, prefix, [0, 1, 2, 3], victim))
    assert not result.succeeded, result.details
    assert generates(swarm)


# ---------------------------------------------------------------- a victim node of the test's own
def record(start: int = 0, end: int = 2) -> ServerInfo:
    return ServerInfo(state=ServerState.ONLINE, start_block=start, end_block=end, throughput=10.0,
                      cache_tokens_total=100, cache_tokens_free=100, torch_dtype="float32", version="test",
                      protocol_version=PROTOCOL_VERSION, max_session_length=64)


def test_a_member_of_a_private_swarm_cannot_erase_another_members_record_and_a_stranger_cannot_join():
    key = SwarmKey(b"k" * 32)

    async def attack():
        boot = await create_swarm_node(swarm_key=key)
        victim = await create_swarm_node(await boot.maddrs(), swarm_key=key)
        try:
            peers = await boot.maddrs()
            assert await announce_blocks(victim.dht, "private", victim.peer_id, record(), 300,
                                         ModelRecord(num_blocks=2))
            member = await dht_attacks.erase_member_record(peers, "private", 0, victim.peer_id, key)
            with pytest.raises(RuntimeError, match="bootstrap failed"):
                await dht_attacks.squat_key(peers, "private", 0)  # no key: cannot even join
            return member
        finally:
            await victim.shutdown()
            await boot.shutdown()

    result = asyncio.run(attack())
    assert not result.succeeded, result.details
    assert result.details.count("failed (") == 3, result.details


def test_a_replayed_older_record_neither_replaces_nor_expires_the_newer_one():
    async def attack():
        boot = await create_swarm_node()
        victim = await create_swarm_node(await boot.maddrs())
        try:
            peers = await boot.maddrs()
            assert await announce_blocks(victim.dht, "replayed", victim.peer_id, record(), 10)  # the one to replay
            captured = asyncio.Event()

            async def announce_newer():  # once the attacker holds the older one (its node may take seconds to start)
                await captured.wait()
                assert await announce_blocks(victim.dht, "replayed", victim.peer_id, record(), 120)

            newer = asyncio.create_task(announce_newer())
            result = await dht_attacks.replay_older_record(peers, "replayed", 0, victim.peer_id, newer_timeout=30,
                                                           max_wait=30, captured=captured)
            await newer
            return result
        finally:
            await victim.shutdown()
            await boot.shutdown()

    result = asyncio.run(attack())
    assert not result.succeeded, result.details
    assert "a newcomer reads the record expiring at" in result.details, result.details

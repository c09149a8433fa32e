"""Record admission (dht.admission, dht.verifier, dht.record_storage): who may store a record, which records a full
key keeps and which ones a lookup is answered with. The rules alone, then real DHT nodes on loopback where sybils --
each its own node with its own identity, the strongest form the sender rule leaves them -- fill a block key first and
a server that answers what it serves still gets in and is found."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from hivemind.dht.routing import DHTID

from corolla.dht import announce_blocks, create_swarm_node, fetch_block_servers
from corolla.dht.admission import FAILED, UNKNOWN, VERIFIED, Held, answer_order, evict_for
from corolla.dht.record_storage import STORE_SENDER, RecordStorage
from corolla.dht.verifier import CHECK_TIMEOUT, RecordVerifier, served_keys
from corolla.protocol import PROTOCOL_VERSION, rpc_handler_name
from corolla.protocol.framing import read_frame, write_frame
from corolla.protocol.messages import InfoReply, ServerInfo, ServerState


def held(subkey: str, rank: int, group: bytes | None = None, expiration: float = 100.0) -> Held:
    return Held(subkey, rank, group if group is not None else subkey.encode(), expiration)


# ---------------------------------------------------------------- the rules
def test_a_key_with_room_admits_anyone():
    assert evict_for([held("a", FAILED)], held("b", FAILED), capacity=2) is True


def test_a_newcomer_takes_the_place_of_the_lowest_ranked_incumbent_only_if_it_ranks_higher():
    full = [held("real", VERIFIED), held("fake1", FAILED, expiration=50.0), held("fake2", FAILED, expiration=70.0)]
    assert evict_for(full, held("new", UNKNOWN), capacity=3).subkey == "fake1"  # the first to expire among the lowest
    assert evict_for(full, held("new", FAILED), capacity=3) is None  # a failed writer never pushes anyone out
    verified = [held(f"s{i}", VERIFIED) for i in range(3)]
    assert evict_for(verified, held("new", VERIFIED), capacity=3) is None  # two servers never push each other out


def test_a_crowded_group_gives_way_to_a_lone_record_of_the_same_rank():
    """The model index: many entries of one model give way to one of a model with none, and once the groups are
    level the evicted entry's refresh does not take its place back."""
    crowd = [held(f"c{i}", UNKNOWN, group=b"crowd") for i in range(4)]
    assert evict_for(crowd, held("lone", UNKNOWN, group=b"lone"), capacity=4).subkey.startswith("c")
    pair = [held("a", UNKNOWN, group=b"m"), held("b", UNKNOWN, group=b"m")]
    assert evict_for(pair, held("lone", UNKNOWN, group=b"lone"), capacity=2) is not None
    level = [held("b", UNKNOWN, group=b"m"), held("lone", UNKNOWN, group=b"lone")]
    assert evict_for(level, held("a", UNKNOWN, group=b"m"), capacity=2) is None


def test_an_answer_holds_verified_records_first_and_every_group_before_a_second_of_any():
    records = [held(f"f{i}", FAILED) for i in range(50)] + [held("real", VERIFIED)]
    records += [held(f"u{i}", UNKNOWN, group=b"crowd") for i in range(20)] + [held("lone", UNKNOWN, group=b"lone")]
    order = answer_order(records, limit=4, rng=random.Random(0))
    assert order[0] == "real" and "lone" in order[:3] and len(order) == 4
    assert not any(subkey.startswith("f") for subkey in order)
    drawn = {tuple(answer_order(records, limit=3, rng=random.Random(seed))) for seed in range(10)}
    assert len(drawn) > 1  # readers asking several nodes see different records of a crowded key


def test_a_node_stores_a_record_only_from_its_own_writer():
    storage, key = RecordStorage(max_subkeys=8), DHTID.generate(source="m.0")
    expiration = time.time() + 60
    token = STORE_SENDER.set("writer")
    try:
        assert storage.store_subkey(key, "writer", b"record", expiration)
        assert not storage.store_subkey(key, "someone-else", b"record", expiration)  # signed by a sybil key it holds
    finally:
        STORE_SENDER.reset(token)
    assert storage.refused == 1 and subkeys(storage, key) == {"writer"}


class Answers:
    """rpc_info answers by peer id, for the verifier (an unknown peer does not answer)."""

    def __init__(self, replies: dict[str, InfoReply]):
        self.replies, self.asked = replies, []

    async def __call__(self, peer: str) -> InfoReply:
        self.asked.append(peer)
        if peer not in self.replies:
            raise ConnectionError("no such server")
        return self.replies[peer]


def info(peer: str, prefix: str, start: int, end: int) -> InfoReply:
    return InfoReply(peer_id=peer, info=server_record(start, end), model="m", dht_prefix=prefix, hidden_size=64,
                     active_sessions=0)


def server_record(start: int = 0, end: int = 1) -> ServerInfo:
    return ServerInfo(state=ServerState.ONLINE, start_block=start, end_block=end, throughput=10.0,
                      cache_tokens_total=100, cache_tokens_free=100, torch_dtype="float32", version="test",
                      protocol_version=PROTOCOL_VERSION, max_session_length=64)


def test_the_verifier_ranks_writers_by_what_they_answer_they_serve():
    async def check() -> dict[str, int]:
        answers = Answers({"server": info("server", "m", 2, 4), "liar": info("someone", "m", 0, 4),
                           "wide": info("wide", "m", 0, 10_000)})
        verifier = RecordVerifier(answers, own_peer_id="me")
        for peer in ("server", "liar", "wide", "silent"):
            verifier.request(peer)
        verifier.request("server")  # queued once
        for _ in range(1000):  # bounded: 10 s
            if verifier.checks == 4:
                break
            await asyncio.sleep(0.01)
        assert answers.asked.count("server") == 1
        block = lambda b: DHTID.generate(source=f"m.{b}")  # noqa: E731
        return {"served": verifier.rank("server", block(3)), "other block": verifier.rank("server", block(0)),
                "index": verifier.rank("server", DHTID.generate(source="_corolla.models")),
                "liar": verifier.rank("liar", block(0)), "wide": verifier.rank("wide", block(0)),
                "silent": verifier.rank("silent", block(0)), "unasked": verifier.rank("new", block(0)),
                "self": verifier.rank("me", block(0))}

    assert asyncio.run(check()) == {"served": VERIFIED, "other block": FAILED, "index": VERIFIED, "liar": FAILED,
                                    "wide": FAILED, "silent": FAILED, "unasked": UNKNOWN, "self": VERIFIED}
    assert served_keys(info("x", "m", 0, 5000)) is None


# ---------------------------------------------------------------- real nodes
async def serve_info(node, prefix: str, start: int, end: int) -> None:
    """Make `node` answer rpc_info as a server of `prefix` blocks start:end does (what storing nodes ask)."""

    async def on_info(stream_info, reader, writer) -> None:
        await read_frame(reader)
        await write_frame(writer, info(node.peer_id, prefix, start, end))
        writer.close()

    await node.p2p.add_binary_stream_handler(rpc_handler_name("info"), on_info)


@pytest.mark.timeout(120)
def test_sybils_that_filled_a_block_key_first_give_way_to_a_server_within_one_announce():
    """Two storing nodes keep at most 4 writers per key. Four sybils, each a DHT node of its own announcing block 0
    (they cannot answer rpc_info as servers of it), fill the key; a server then announces: refused or admitted at its
    first announce, it is in by its second (the sybils were checked and ranked FAILED), and a newcomer finds it. A
    fifth sybil then cannot push it out."""
    capacity, prefix = 4, "admission"

    async def run() -> tuple[int, bool, bool]:
        boot = await create_swarm_node()
        nodes = [boot]
        try:
            peers = await boot.maddrs()
            storer = await create_swarm_node(peers)
            nodes.append(storer)
            for node in (boot, storer):
                node.dht.protocol.storage.max_subkeys = capacity
            for _ in range(capacity):
                sybil = await create_swarm_node(peers, client_mode=True)
                nodes.append(sybil)
                assert await announce_blocks(sybil.dht, prefix, sybil.peer_id, server_record(), 300)
            server = await create_swarm_node(peers, client_mode=True)
            nodes.append(server)
            await serve_info(server, prefix, 0, 1)
            announces = 0
            for announces in range(1, 4):
                await announce_blocks(server.dht, prefix, server.peer_id, server_record(), 300)
                if all(server.peer_id in storage_of(node, prefix) for node in (boot, storer)):
                    break
                # the announce period of this test: by the next one, the writers are checked (each check is bounded
                # by CHECK_TIMEOUT; a loaded machine may take that long to find a sybil silent)
                await wait_checked(boot, storer, count=1 + capacity, deadline=CHECK_TIMEOUT + 10.0)
            reader = await create_swarm_node(peers, client_mode=True)
            nodes.append(reader)
            found = server.peer_id in (await fetch_block_servers(reader.dht, prefix, [0]))[0]
            late = await create_swarm_node(peers, client_mode=True)
            nodes.append(late)
            await announce_blocks(late.dht, prefix, late.peer_id, server_record(), 300)
            kept = all(server.peer_id in storage_of(node, prefix) for node in (boot, storer))
            return announces, found, kept
        finally:
            for node in reversed(nodes):
                await node.shutdown()

    announces, found, kept = asyncio.run(run())
    assert announces <= 2 and found and kept, (announces, found, kept)


async def wait_checked(*nodes, count: int, deadline: float) -> None:
    """Until each node's verifier has checked `count` writers (or `deadline` seconds passed)."""
    end = time.monotonic() + deadline
    while time.monotonic() < end and any(node.verifier.checks < count for node in nodes):
        await asyncio.sleep(0.1)


def storage_of(node, prefix: str) -> set[str]:
    return subkeys(node.dht.protocol.storage, DHTID.generate(source=f"{prefix}.0"))


def subkeys(storage: RecordStorage, key: DHTID) -> set[str]:
    held_now = storage.get(key)
    if held_now is None:
        return set()
    with held_now.value.freeze():
        return {str(subkey) for subkey, _ in held_now.value.items()}

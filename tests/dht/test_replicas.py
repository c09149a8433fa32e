"""dht.replicas: a server's announce stores its records where the last one did, with no DHT search, and searches
again for a key whose holder is gone, whose holders are old, or after forget(); readers find every announce's
record either way. Real DHT nodes on loopback."""

from __future__ import annotations

import asyncio
import random
from contextlib import asynccontextmanager

import pytest

from corolla.dht import announce_blocks, create_swarm_node, fetch_block_servers
from corolla.dht.replicas import ReplicaSet
from corolla.protocol import PROTOCOL_VERSION
from corolla.protocol.messages import ServerInfo, ServerState

PREFIX = "replicas"


def record(free: int, start: int = 0, end: int = 3) -> ServerInfo:
    return ServerInfo(state=ServerState.ONLINE, start_block=start, end_block=end, throughput=10.0,
                      cache_tokens_total=1000, cache_tokens_free=free, torch_dtype="float32", version="test",
                      protocol_version=PROTOCOL_VERSION, max_session_length=64)


async def read_free(reader, server_id: str, blocks: range) -> list[int | None]:
    found = await fetch_block_servers(reader.dht, PREFIX, blocks)
    return [by_peer[server_id].cache_tokens_free if server_id in by_peer else None for by_peer in found]


@asynccontextmanager
async def dht_nodes(count: int):
    """A bootstrap node and `count` more DHT nodes joined through it (all shut down at the end); yields the list,
    which the test may extend with nodes to shut down too."""
    boot = await create_swarm_node()
    nodes = [boot]
    try:
        peers = await boot.maddrs()
        for _ in range(count):
            nodes.append(await create_swarm_node(peers))
        yield nodes
    finally:
        for node in reversed(nodes):
            await node.shutdown()


@pytest.mark.timeout(180)
def test_announces_store_at_the_known_holders_and_search_again_only_when_needed():
    async def run() -> None:
        async with dht_nodes(6) as nodes:
            peers = await nodes[0].maddrs()
            server = await create_swarm_node(peers)
            nodes.append(server)
            reader = await create_swarm_node(peers, client_mode=True)
            nodes.append(reader)
            replicas = ReplicaSet(rng=random.Random(0))

            # the first announce searches for every key; readers find it
            assert await announce_blocks(server.dht, PREFIX, server.peer_id, record(900), 300, replicas=replicas)
            assert (replicas.searches, replicas.direct) == (3, 0)
            assert await read_free(reader, server.peer_id, range(3)) == [900] * 3
            holders = {peer for block in range(3) for peer in replicas.holders(f"{PREFIX}.{block}")}
            assert 0 < len(replicas.holders(f"{PREFIX}.0")) <= server.dht.num_replicas

            # the next ones store there directly, and readers see each new record
            for free in (800, 700):
                assert await announce_blocks(server.dht, PREFIX, server.peer_id, record(free), 300, replicas=replicas)
                assert await read_free(reader, server.peer_id, range(3)) == [free] * 3
            assert (replicas.searches, replicas.direct) == (3, 6)

            # a holder leaves: the keys it held are searched for again at once, the others are not
            victim = next(node for node in nodes[1:7] if node.p2p.peer_id in holders)
            held_by_victim = [b for b in range(3) if victim.p2p.peer_id in replicas.holders(f"{PREFIX}.{b}")]
            await victim.shutdown()
            nodes.remove(victim)
            assert await announce_blocks(server.dht, PREFIX, server.peer_id, record(600), 300, replicas=replicas)
            assert replicas.searches == 3 + len(held_by_victim)
            assert all(victim.p2p.peer_id not in replicas.holders(f"{PREFIX}.{b}") for b in range(3))
            assert await read_free(reader, server.peer_id, range(3)) == [600] * 3

            # forget(): every key is searched for again; a server that moves searches for its new keys only
            replicas.forget()
            searches = replicas.searches
            assert await announce_blocks(server.dht, PREFIX, server.peer_id, record(500), 300, replicas=replicas)
            assert replicas.searches == searches + 3
            assert await announce_blocks(server.dht, PREFIX, server.peer_id, record(400, 2, 5), 300,
                                         replicas=replicas)
            assert replicas.searches == searches + 5
            assert await read_free(reader, server.peer_id, range(2, 5)) == [400] * 3

    asyncio.run(run())


@pytest.mark.timeout(120)
def test_holders_are_searched_for_again_after_the_refresh_time():
    async def run() -> None:
        async with dht_nodes(1) as nodes:
            server = await create_swarm_node(await nodes[0].maddrs())
            nodes.append(server)
            replicas = ReplicaSet(refresh=0.2, rng=random.Random(1))
            assert await announce_blocks(server.dht, PREFIX, server.peer_id, record(900, 0, 2), 300, replicas=replicas)
            assert await announce_blocks(server.dht, PREFIX, server.peer_id, record(800, 0, 2), 300, replicas=replicas)
            assert (replicas.searches, replicas.direct) == (2, 2)
            await asyncio.sleep(0.3)
            assert await announce_blocks(server.dht, PREFIX, server.peer_id, record(700, 0, 2), 300, replicas=replicas)
            assert (replicas.searches, replicas.direct) == (4, 2)

    asyncio.run(run())

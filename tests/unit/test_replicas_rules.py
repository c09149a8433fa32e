"""dht.replicas on a fake DHT node (what it asks the DHT, not the DHT itself; tests/dht/test_replicas.py runs real
nodes): which nodes get which keys when a nearest node does not answer, and a node that is one key's spare and
another key's first choice."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

from hivemind.dht.routing import DHTID
from hivemind.utils.serializer import MSGPackSerializer

from corolla.dht.replicas import ReplicaSet


class FakeDHT:
    """find_nearest_nodes answers `nearest[key]` (node names, nearest first); nodes in `dead` never answer a store."""

    def __init__(self, nearest: dict[str, list[str]], dead: set[str], num_replicas: int):
        self.node_id = DHTID.generate(source="me")
        self.num_replicas = num_replicas
        self.ids = {name: DHTID.generate(source=name) for names in nearest.values() for name in names}
        self.names = {node: name for name, node in self.ids.items()}
        self.nearest = {DHTID.generate(source=key): [self.ids[n] for n in names] for key, names in nearest.items()}
        self.dead = dead
        self.stores: list[tuple[str, list[DHTID]]] = []  # (node name, keys) per store request
        self.protocol = SimpleNamespace(serializer=MSGPackSerializer, record_validator=None, call_store=self._store)

    async def find_nearest_nodes(self, key_ids, k_nearest):
        return {key_id: {node: f"peer-{self.names[node]}" for node in self.nearest[key_id][:k_nearest]}
                for key_id in key_ids}

    async def _store(self, peer, keys, values, expiration_time, subkeys):
        name = peer.removeprefix("peer-")
        self.stores.append((name, list(keys)))
        return None if name in self.dead else [True] * len(keys)


def test_a_spare_of_one_key_that_is_another_keys_holder_gets_both_and_both_count():
    dht = FakeDHT({"a": ["dead", "y"], "b": ["y", "z"]}, dead={"dead"}, num_replicas=1)
    replicas = ReplicaSet(rng=random.Random(0))
    stored = asyncio.run(replicas.store(dht, ["a", "b"], [1, 2], 100.0, "me"))
    assert stored == {"a": True, "b": True}
    assert replicas.holders("a") == ["peer-y"] and replicas.holders("b") == ["peer-y"]
    assert [name for name, _ in dht.stores].count("dead") == 1  # a silent node is not tried again as a spare


def test_the_next_store_goes_to_the_holders_in_one_request_each_and_a_silent_holder_means_a_new_search():
    dht = FakeDHT({"a": ["x", "y", "w"], "b": ["y", "x", "w"]}, dead=set(), num_replicas=2)
    replicas = ReplicaSet(rng=random.Random(0))
    asyncio.run(replicas.store(dht, ["a", "b"], [1, 2], 100.0, "me"))
    dht.stores.clear()
    asyncio.run(replicas.store(dht, ["a", "b"], [3, 4], 200.0, "me"))
    assert sorted((name, len(keys)) for name, keys in dht.stores) == [("x", 2), ("y", 2)]
    assert (replicas.searches, replicas.direct) == (2, 2)
    dht.dead = {"x"}
    stored = asyncio.run(replicas.store(dht, ["a", "b"], [5, 6], 300.0, "me"))
    assert stored == {"a": True, "b": True} and replicas.searches == 4
    assert set(replicas.holders("a")) == {"peer-y", "peer-w"} == set(replicas.holders("b"))

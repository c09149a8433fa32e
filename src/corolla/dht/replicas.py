"""Storing a node's own records again where they were stored last time, without a DHT traversal each time.

hivemind's `DHTNode.store_many` finds the nodes nearest each key anew at every call: a beam search over up to
bucket_size (20) nodes per key, each of which answers with every record it holds under the key, each of those
records decoded and its signature checked. A server re-announces its records every period, so at 48 servers that
search was most of an idle server's CPU, and answering the others' searches most of the rest (docs/benchmarks.md,
"idle CPU at 48 servers"). The nodes nearest a key change only when nodes join or leave, so `ReplicaSet`
remembers, per key, which nodes answered the last store (`holders`) and the next announce stores there directly:
one store request per holder, carrying every key it holds, and no search.

A key is searched for again (`hivemind find_nearest_nodes`, then stores to the nearest `num_replicas`, as
store_many would) when:
- it has no holders yet (never stored, or this server moved to other blocks);
- its holders were found more than `refresh` seconds ago (drawn per key in [0.75, 1] x REFRESH, so that servers
  started together do not all search in the same period): a node that joined nearer the key gets the record then;
- a holder did not answer the last direct store (gone, or cut off): searched at once, in the same call;
- `forget()` was called (the node rejoined the swarm after an outage: its view of who is near is stale).

What a store returns per key is what store_many returns: True when at least one node stored the record.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any, Sequence

from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID

REFRESH = 300.0  # seconds after which a key's holders are searched for again (at the latest)
SPARE = 3  # nodes found beyond num_replicas per key, tried when a nearer one does not answer


@dataclass
class _Holders:
    nodes: list[tuple[DHTID, PeerID]]
    expires: float  # time.monotonic() after which the key is searched for again


class ReplicaSet:
    """Per DHT key, the nodes that hold this node's record of it; `store` keeps it up to date."""

    def __init__(self, refresh: float = REFRESH, rng: random.Random | None = None):
        self.refresh = refresh
        self._rng = rng or random.Random()
        self._holders: dict[DHTID, _Holders] = {}
        self.searches = 0  # keys searched for (a traversal each), for tests and logs
        self.direct = 0  # keys stored at their known holders without a search

    def forget(self) -> None:
        """Search for every key again at the next store."""
        self._holders.clear()

    def holders(self, key: Any) -> list[PeerID]:
        """The peers that held `key`'s record at the last store (empty when unknown)."""
        entry = self._holders.get(DHTID.generate(source=key))
        return [peer for _, peer in entry.nodes] if entry else []

    async def store(self, dht: DHTNode, keys: Sequence[Any], values: Sequence[Any], expiration: float,
                    subkey: Any) -> dict[Any, bool]:
        """Store `values[i]` under (`keys[i]`, `subkey`) until `expiration`, signed as store_many signs them; for each
        key, whether some node stored it."""
        protocol = dht.protocol
        subkey_bytes = protocol.serializer.dumps(subkey)
        records: dict[DHTID, tuple[Any, bytes]] = {}
        for key, value in zip(keys, values):
            key_id = DHTID.generate(source=key)
            record = DHTRecord(key_id.to_bytes(), subkey_bytes, protocol.serializer.dumps(value), expiration)
            sealed = protocol.record_validator.sign_value(record) if protocol.record_validator else record.value
            records[key_id] = (key, sealed)
        now = time.monotonic()
        self._holders = {k: v for k, v in self._holders.items() if v.expires > now}
        known = {key_id: self._holders[key_id].nodes for key_id in records if key_id in self._holders}
        stored: dict[DHTID, bool] = {}
        if known:
            answers = await self._store_at(dht, known, records, expiration, subkey)
            for key_id, nodes in known.items():
                if all(answers[node, key_id] is not None for node, _ in nodes):
                    stored[key_id] = any(answers[node, key_id] for node, _ in nodes)
                    self.direct += 1
                else:  # a holder is gone: search again now
                    self._holders.pop(key_id, None)
        missing = [key_id for key_id in records if key_id not in stored]
        if missing:
            stored |= await self._search_and_store(dht, missing, records, expiration, subkey)
        return {records[key_id][0]: ok for key_id, ok in stored.items()}

    async def _search_and_store(self, dht: DHTNode, key_ids: list[DHTID], records: dict[DHTID, tuple[Any, bytes]],
                                expiration: float, subkey: Any) -> dict[DHTID, bool]:
        self.searches += len(key_ids)
        found = await dht.find_nearest_nodes(key_ids, k_nearest=dht.num_replicas + SPARE)
        candidates = {key_id: list(found.get(key_id, {}).items()) for key_id in key_ids}
        tried = {key_id: nodes[: dht.num_replicas] for key_id, nodes in candidates.items()}
        answers = await self._store_at(dht, tried, records, expiration, subkey)
        silent = {node for (node, _), done in answers.items() if done is None}
        spares = {}
        for key_id, nodes in tried.items():
            lost = sum(node in silent for node, _ in nodes)
            spares[key_id] = [(node, peer) for node, peer in candidates[key_id][dht.num_replicas:]
                              if node not in silent][:lost]
        if any(spares.values()):
            answers |= await self._store_at(dht, spares, records, expiration, subkey)
        result = {}
        for key_id in key_ids:
            holders = [(node, peer) for node, peer in tried[key_id] + spares[key_id]
                       if answers[node, key_id] is not None]
            result[key_id] = any(answers[node, key_id] for node, _ in holders)
            if holders:
                self._holders[key_id] = _Holders(holders, time.monotonic() + self.refresh * self._rng.uniform(0.75, 1))
        return result

    async def _store_at(self, dht: DHTNode, nodes_of: dict[DHTID, list[tuple[DHTID, PeerID]]],
                        records: dict[DHTID, tuple[Any, bytes]], expiration: float, subkey: Any,
                        ) -> dict[tuple[DHTID, DHTID], bool | None]:
        """One store request per node, carrying every key it is to hold; per (node, key), whether the node stored
        the record (None: the node did not answer). This node stores its own share locally, as store_many does."""
        per_node: dict[DHTID, list[DHTID]] = {}
        peers: dict[DHTID, PeerID] = {}
        for key_id, nodes in nodes_of.items():
            for node, peer in nodes:
                per_node.setdefault(node, []).append(key_id)
                peers[node] = peer

        async def one(node: DHTID) -> list[bool] | None:
            key_ids = per_node[node]
            if node == dht.node_id:
                return [_store_locally(dht, key_id, records[key_id][1], expiration, subkey) for key_id in key_ids]
            return await dht.protocol.call_store(peers[node], keys=key_ids, values=[records[k][1] for k in key_ids],
                                                 expiration_time=expiration, subkeys=[subkey] * len(key_ids))

        nodes = list(per_node)
        results = await asyncio.gather(*(one(node) for node in nodes))
        answers: dict[tuple[DHTID, DHTID], bool | None] = {}
        for node, done in zip(nodes, results):
            for i, key_id in enumerate(per_node[node]):
                answers[node, key_id] = None if done is None or i >= len(done) else bool(done[i])
        return answers


def _store_locally(dht: DHTNode, key_id: DHTID, sealed: bytes, expiration: float, subkey: Any) -> bool:
    protocol = dht.protocol
    validator = protocol.record_validator
    record = DHTRecord(key_id.to_bytes(), protocol.serializer.dumps(subkey), sealed, expiration)
    if validator is not None and not validator.validate(record):
        return False
    return bool(protocol.storage.store(key_id, sealed, expiration, subkey=subkey))

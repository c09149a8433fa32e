"""Reading records from the DHT without letting one answer decide for the others.

hivemind's `DHTNode.get(key, sufficient_expiration_time=inf)` (a fresh view: ask every node near the key) ends its
search as soon as one answer claims an expiration at or past the sufficient one; an answer's outer expiration is
whatever the answering peer writes, and an empty dictionary validates trivially. So one hostile DHT node near a
key could answer "{} until +inf" and readers would see no server under that key at all.

`lookup` walks the same nodes (hivemind's traverse_dht, the node's routing table and blacklist) but never stops
early and ignores outer expirations: per (key, subkey) it keeps the record with the latest expiration among this
node's storage, its cache and every answer, each answer validated by the node's record validator
(dht.signed_records) before it is merged. Records that expired, or expire further ahead than any honest node
stores, are dropped one by one (never a whole answer).

What one answer can cost is bounded: an answer holding more records under a key than an honest node answers with
(MAX_ANSWER_RECORDS: dht.admission.ANSWER_RECORDS, or 256 from nodes of earlier versions), or more bytes than those
can take, is dropped before anything in it is decoded or any signature checked, so a peer answering with 10,000
records costs a reader no more than one with 256.

Each record comes with its *support* (`lookup_supported`): how many of the sources asked (this node's storage, each
answering node) hold it. A writer's own record is stored on every node near the key; records that only a hostile node
answers with (it keeps whatever it likes) have a support of one, so readers that must choose among too many records
keep the well supported ones (dht.records, dht.model_index).
Each request names at most `keys_per_call` keys (a few: fewer round trips); when a peer does not answer such a
request, the keys are asked again one per request, whose answer stays below hivemind's limit on a unary answer
(2 MiB) even when the key is full (MAX_ANSWER_RECORDS records of signed_records.MAX_RECORD_BYTES each: ~1 MiB),
so keys flooded with large records cannot hide the others (they cost the reader one RPC timeout).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Collection, NamedTuple, Sequence

import msgpack
from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.traverse import traverse_dht
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.proto import dht_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer

from corolla.dht.admission import ANSWER_RECORDS
from corolla.dht.record_storage import MAX_CLOCK_SKEW, MAX_RECORD_AHEAD
from corolla.dht.signed_records import MAX_RECORD_BYTES

logger = logging.getLogger(__name__)

KEYS_PER_CALL = 4  # keys named in one find request (see the module docstring)
# requests in flight at once: the same nodes are asked, sooner. Over 45-72 ms round trips (emulated hosts, 70 DHT
# peers) a lookup of 16 keys took 2.0 s with the node's own 4 workers, 0.7 s with 16 and 0.4-0.7 s with 32: each
# request to a node not met yet waits for a dial (~5 round trips)
LOOKUP_WORKERS = 32
MAX_ANSWER_RECORDS = max(ANSWER_RECORDS, 256)  # records under one key in one answer (older nodes answered 256)
MAX_ANSWER_BYTES = MAX_ANSWER_RECORDS * (MAX_RECORD_BYTES + 256)  # one key's records in an answer, serialized

Records = dict[str, tuple[Any, float]]  # subkey (a writer's peer id) -> (value, expiration time)


class Found(NamedTuple):
    """One record as a lookup found it."""

    value: Any  # as its writer stored it
    expiration: float
    support: int  # sources (this node's storage and cache count one, each answering node one) that hold it


async def lookup(dht: DHTNode, keys: Sequence[str], keys_per_call: int = KEYS_PER_CALL) -> dict[str, Records]:
    """For each key, every live record under it: subkey -> (value as its writer stored it, expiration), merged from
    this node's storage and cache and every DHT node the search reaches (see the module docstring). Keys nobody
    holds map to {}. Never raises for a peer's failure (that peer's answer is missing); records that do not
    deserialize are dropped."""
    found = await lookup_supported(dht, keys, keys_per_call)
    return {key: {subkey: (item.value, item.expiration) for subkey, item in records.items()}
            for key, records in found.items()}


async def lookup_supported(dht: DHTNode, keys: Sequence[str], keys_per_call: int = KEYS_PER_CALL
                           ) -> dict[str, dict[str, Found]]:
    """`lookup`, with each record's support (see the module docstring)."""
    key_ids = {DHTID.generate(source=key): key for key in keys}
    merged: dict[DHTID, dict[Any, list]] = {key_id: {} for key_id in key_ids}
    for key_id in key_ids:
        local: dict[Any, list] = {}
        for source in (dht.protocol.storage, dht.protocol.cache):
            held = source.get(key_id)
            if held is not None:
                _merge(local, held.value)
        _merge_counted(merged[key_id], local)
    if key_ids:
        await _traverse(dht, list(key_ids), merged, keys_per_call)
    return {key: _decode(dht, key_id, merged[key_id]) for key_id, key in key_ids.items()}


async def _traverse(dht: DHTNode, key_ids: list[DHTID], merged: dict[DHTID, dict[Any, list]],
                    keys_per_call: int) -> None:
    node_to_peer: dict[DHTID, PeerID] = {}
    for key_id in key_ids:
        for node_id, peer in dht.protocol.routing_table.get_nearest_neighbors(key_id, dht.protocol.bucket_size,
                                                                             exclude=dht.node_id):
            if peer not in dht.blacklist:
                node_to_peer[node_id] = peer

    async def get_neighbors(node_id: DHTID, queries: Collection[DHTID]) -> dict[DHTID, tuple[tuple[DHTID, ...], bool]]:
        queries = list(queries)
        peer = node_to_peer[node_id]
        response = None if peer in dht.blacklist else await _call_find(dht, peer, queries)
        if response is None and len(queries) > 1 and peer not in dht.blacklist:  # maybe too large an answer
            parts = await asyncio.gather(*(_call_find(dht, peer, [query]) for query in queries))
            response = {k: v for part in parts if part for k, v in part.items()} or None
        if not response:
            dht.blacklist.register_failure(peer)
            return {query: ((), False) for query in queries}
        dht.blacklist.register_success(peer)
        output = {}
        for key_id, (found, nearest) in response.items():
            nearest = {n: p for n, p in nearest.items() if p not in dht.blacklist}
            node_to_peer.update(nearest)
            if found is not None and key_id in merged:
                answer: dict[Any, list] = {}
                _merge(answer, found)
                _merge_counted(merged[key_id], answer)
            output[key_id] = tuple(nearest), False  # never stop early: every node near the key is asked
        return output

    await traverse_dht(
        queries=key_ids, initial_nodes=list(node_to_peer), beam_size=dht.protocol.bucket_size,
        num_workers=max(dht.num_workers, LOOKUP_WORKERS), queries_per_call=max(1, keys_per_call),
        get_neighbors=get_neighbors,
        visited_nodes={key_id: {dht.node_id} for key_id in key_ids}, await_all_tasks=True,
    )


async def _call_find(dht: DHTNode, peer: PeerID, key_ids: list[DHTID]
                     ) -> dict[DHTID, tuple[DictionaryDHTValue | None, dict[DHTID, PeerID]]] | None:
    """hivemind's DHTProtocol.call_find, but an answer's dictionaries are bounded before they are decoded and
    validated (see the module docstring); None when the peer did not answer."""
    protocol = dht.protocol
    request = dht_pb2.FindRequest(keys=[key_id.to_bytes() for key_id in key_ids], peer=protocol.node_info)
    try:
        async with protocol.rpc_semaphore:
            response = await protocol.get_stub(peer).rpc_find(request, timeout=protocol.wait_timeout)
        if len(response.results) != len(key_ids):
            raise ValueError(f"{len(response.results)} results for {len(key_ids)} keys")
    except Exception as e:  # p2pd and the authorizer raise assorted types for a peer that does not answer well
        logger.debug("find at %s failed: %r", peer, e)
        asyncio.create_task(protocol.update_routing_table(protocol.routing_table.get(peer_id=peer), peer,
                                                          responded=False))
        return None
    if response.peer and response.peer.node_id:
        asyncio.create_task(protocol.update_routing_table(DHTID.from_bytes(response.peer.node_id), peer))
    output = {}
    for key_id, result in zip(key_ids, response.results):
        nearest = dict(zip(map(DHTID.from_bytes, result.nearest_node_ids), map(PeerID, result.nearest_peer_ids)))
        found = None
        if result.type == dht_pb2.FOUND_DICTIONARY:
            found = _bounded_dictionary(dht, key_id, result.value, peer)
        output[key_id] = found, nearest
    return output


def _bounded_dictionary(dht: DHTNode, key_id: DHTID, raw: bytes, peer: PeerID) -> DictionaryDHTValue | None:
    """The records of an answer's dictionary, when it holds no more than an honest node keeps and every record
    validates; None otherwise (the whole answer for that key is dropped, as hivemind drops it)."""
    if len(raw) > MAX_ANSWER_BYTES or _records_in(raw) > MAX_ANSWER_RECORDS:
        logger.debug("dropping an answer from %s holding more records than an honest node keeps", peer)
        return None
    try:
        dictionary = MSGPackSerializer.loads(raw)
    except Exception:  # msgpack raises assorted types for garbage
        return None
    if not isinstance(dictionary, DictionaryDHTValue):
        return None
    validator, key_bytes = dht.protocol.record_validator, key_id.to_bytes()
    if validator is not None:
        with dictionary.freeze():
            for subkey, (value, expiration) in dictionary.items():
                if not validator.validate(DHTRecord(key_bytes, MSGPackSerializer.dumps(subkey), value, expiration)):
                    return None
    return dictionary


def _records_in(raw: bytes) -> int:
    """How many records a serialized DictionaryDHTValue holds, read from its headers only (a large number for
    anything else, so it is dropped)."""
    try:
        ext = msgpack.unpackb(raw, ext_hook=lambda code, data: data, raw=True)  # the ext's body, not decoded
        unpacker = msgpack.Unpacker(raw=True)
        unpacker.feed(ext)
        if unpacker.read_array_header() != 3:  # [maxsize, latest expiration, items]
            return MAX_ANSWER_RECORDS + 1
        unpacker.skip()
        unpacker.skip()
        return unpacker.read_array_header()
    except Exception:
        return MAX_ANSWER_RECORDS + 1


def _merge(into: dict[Any, list], value: object) -> None:
    """Add a (validated) dictionary's records, keeping the latest expiration per subkey; anything else is ignored.
    `into`: subkey -> [data, expiration, support]."""
    if not isinstance(value, DictionaryDHTValue):
        return
    with value.freeze():  # read every record as sent; expiry is judged in _decode, by our clock
        for subkey, (data, expiration) in value.items():
            held = into.get(subkey)
            if isinstance(data, bytes) and isinstance(expiration, (int, float)) and (
                    held is None or expiration > held[1]):
                into[subkey] = [data, float(expiration), 1]


def _merge_counted(into: dict[Any, list], source: dict[Any, list]) -> None:
    """Add one source's records (from `_merge`) to what the lookup found: the latest version of each, and one more
    source holding it."""
    for subkey, (data, expiration, _) in source.items():
        held = into.get(subkey)
        if held is None:
            into[subkey] = [data, expiration, 1]
            continue
        held[2] += 1
        if expiration > held[1]:
            held[0], held[1] = data, expiration


def _decode(dht: DHTNode, key_id: DHTID, records: dict[Any, list]) -> dict[str, Found]:
    now = get_dht_time()
    validator = dht.protocol.record_validator
    out: dict[str, Found] = {}
    for subkey, (data, expiration, support) in records.items():
        if not isinstance(subkey, str) or not now <= expiration <= now + MAX_RECORD_AHEAD + MAX_CLOCK_SKEW:
            continue
        if validator is not None:
            record = DHTRecord(key_id.to_bytes(), MSGPackSerializer.dumps(subkey), data, expiration)
            data = validator.strip_value(record)
        try:
            out[subkey] = Found(MSGPackSerializer.loads(data), expiration, support)
        except Exception as e:  # msgpack raises assorted types for garbage
            logger.debug("dropping an undecodable record under subkey %s: %r", subkey, e)
    return out

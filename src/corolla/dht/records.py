"""DHT records: key `"{prefix}.{block}"`, subkey = server peer id, value = ServerInfo (as a plain dict).

Records are signed by their server and bound to its peer id (dht.signed_records): a node can announce only itself.
Readers keep at most MAX_SERVERS_PER_BLOCK records per block, so a flood of records under fresh peer ids costs a
reader a bounded amount of work (the storing nodes bound a key's writers and what they answer with too:
dht.record_storage, dht.admission); over that many, the peers the caller prefers first, then the best supported
(held by the most nodes asked: a writer's own record is stored on every node near the key, a hostile node's fakes
only there, dht.lookup), then in an order drawn once per process.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
from typing import Collection, Mapping, Sequence

from hivemind.dht.node import DHTNode
from hivemind.utils import get_dht_time
from pydantic import ValidationError

from corolla.dht.lookup import lookup_supported
from corolla.dht.model_index import MODEL_INDEX_KEY, IndexEntry, ModelRecord
from corolla.dht.record_storage import MAX_RECORD_LIFETIME
from corolla.dht.replicas import ReplicaSet
from corolla.protocol.messages import ServerInfo

logger = logging.getLogger(__name__)

MAX_SERVERS_PER_BLOCK = 256  # records a reader keeps per block (see the module doc for which)


_SALT = secrets.token_bytes(16)  # this process's draw of which records to keep when a block holds too many


def _drawn(peer: str) -> bytes:
    return hashlib.sha256(_SALT + peer.encode(errors="replace")).digest()


def model_dht_prefix(model: str) -> str:
    """The DHT namespace of a model: the last component of its repo id or directory, in safe characters.

    "meta-llama/Llama-2-7b-hf" -> "Llama-2-7b-hf"; "/data/ckpt/tiny-llama/" -> "tiny-llama".
    """
    name = os.path.basename(os.path.normpath(str(model))) or str(model)
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", name).strip("-")
    return name or "model"


def block_key(prefix: str, block: int) -> str:
    return f"{prefix}.{block}"


async def announce_blocks(
    dht: DHTNode, prefix: str, peer_id: str, info: ServerInfo, expiration_s: float, model: ModelRecord | None = None,
    replicas: ReplicaSet | None = None,
) -> bool:
    """Store `info` under every block of info's range (subkey `peer_id`: the node's own, the only one it can sign
    for), and `model` (if given) as this server's entry in the swarm's model index (see dht.model_index), in one DHT
    round; returns True when every block record was stored (the index entry is best effort: a full index must not
    make a server re-announce in a loop). `expiration_s` is capped at the longest lifetime DHT nodes accept.
    `replicas`: store where the last announce stored, without a DHT search (dht.replicas; a server's announcer keeps
    one); without it, hivemind's store_many searches for the nearest nodes of every key."""
    if expiration_s > MAX_RECORD_LIFETIME:
        logger.warning("record expiration %.0fs capped at %.0fs (DHT nodes refuse longer ones)", expiration_s,
                       MAX_RECORD_LIFETIME)
    expiration = get_dht_time() + min(expiration_s, MAX_RECORD_LIFETIME)
    keys = [block_key(prefix, b) for b in range(info.start_block, info.end_block)]
    values: list[object] = [info.model_dump(mode="json")] * len(keys)
    if model is not None:
        keys.append(MODEL_INDEX_KEY)
        values.append(IndexEntry(prefix=prefix, **model.model_dump()).model_dump(mode="json"))
    if replicas is not None:
        results = await replicas.store(dht, keys, values, expiration, peer_id)
    else:
        stored = await dht.store_many(keys, values, expiration, subkeys=[peer_id] * len(keys))
        results = {key: ok for (key, _), ok in stored.items()}
    if model is not None and not results.get(MODEL_INDEX_KEY, False):
        logger.debug("the model index entry was not stored")
    return all(ok for key, ok in results.items() if key != MODEL_INDEX_KEY)


async def fetch_block_servers(
    dht: DHTNode, prefix: str, blocks: Sequence[int], prefer: Collection[str] = (),
    max_servers: int = MAX_SERVERS_PER_BLOCK,
) -> list[dict[str, ServerInfo]]:
    """For each block, the servers that announced it (peer id -> ServerInfo), read fresh from the DHT (dht.lookup),
    dropping malformed records. Over `max_servers` records under one block, the peers in `prefer` (e.g. the ones
    that answered before) are kept first, then the best supported (see the module doc), then the others in an order
    drawn once per process (peer ids or expirations chosen by a writer cannot put it first)."""
    keys = [block_key(prefix, b) for b in blocks]
    found = await lookup_supported(dht, keys) if keys else {}
    per_key: list[dict[str, tuple[ServerInfo, float]]] = []
    for key in keys:
        records = found.get(key, {})
        kept = sorted(records, key=lambda peer: (peer not in prefer, -records[peer].support, _drawn(peer)))
        kept = kept[:max_servers]
        if len(records) > max_servers:
            logger.debug("key %s holds %d records; reading %d", key, len(records), max_servers)
        servers: dict[str, tuple[ServerInfo, float]] = {}
        for peer in sorted(kept):
            try:
                info = ServerInfo.model_validate(records[peer].value)
            except (ValidationError, TypeError) as e:
                logger.debug("ignoring malformed record key=%s peer=%s error=%s", key, peer, e)
                continue
            servers[peer] = (info, records[peer].expiration)
        per_key.append(servers)
    return latest_records(blocks, per_key)


def latest_records(blocks: Sequence[int], per_key: Sequence[Mapping[str, tuple[ServerInfo, float]]]
                   ) -> list[dict[str, ServerInfo]]:
    """For each block, its servers by their latest record (the one that expires last, among every block key read),
    each listed only under the blocks that record names. A server's records under the keys of blocks it left (it
    moved: they are OFFLINE, or stale until they expire) or never held (it announced different ranges under
    different keys) are not read as its own: a client pricing a server by one record and listing it by another found
    no route at all (every session failed at once with "Total of weights must be greater than zero"). Pure."""
    latest: dict[str, tuple[float, ServerInfo]] = {}
    for servers in per_key:
        for peer, (info, expiration) in servers.items():
            if peer not in latest or expiration > latest[peer][0]:
                latest[peer] = (expiration, info)
    return [{peer: latest[peer][1] for peer in servers
             if latest[peer][1].start_block <= block < latest[peer][1].end_block}
            for block, servers in zip(blocks, per_key)]

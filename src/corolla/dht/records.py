"""DHT records: key `"{prefix}.{block}"`, subkey = server peer id, value = ServerInfo (as a plain dict)."""

from __future__ import annotations

import logging
import os
import re
from typing import Sequence

from hivemind.dht.node import DHTNode
from hivemind.utils import get_dht_time
from pydantic import ValidationError

from corolla.dht.model_index import MODEL_INDEX_KEY, ModelRecord
from corolla.protocol.messages import ServerInfo

logger = logging.getLogger(__name__)


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
    dht: DHTNode, prefix: str, peer_id: str, info: ServerInfo, expiration_s: float, model: ModelRecord | None = None
) -> bool:
    """Store `info` under every block of info's range, and `model` (if given) in the swarm's model index under
    `prefix` (see dht.model_index), in one DHT round; returns True when all stores succeeded."""
    expiration = get_dht_time() + expiration_s
    keys = [block_key(prefix, b) for b in range(info.start_block, info.end_block)]
    values: list[object] = [info.model_dump(mode="json")] * len(keys)
    subkeys = [peer_id] * len(keys)
    if model is not None:
        keys.append(MODEL_INDEX_KEY)
        values.append(model.model_dump(mode="json"))
        subkeys.append(prefix)
    results = await dht.store_many(keys, values, expiration, subkeys=subkeys)
    return all(results.values())


async def fetch_block_servers(
    dht: DHTNode, prefix: str, blocks: Sequence[int]
) -> list[dict[str, ServerInfo]]:
    """For each block, the servers that announced it (peer id -> ServerInfo), dropping malformed records."""
    keys = [block_key(prefix, b) for b in blocks]
    # an infinite sufficient expiration asks the peers, not our local cache: a fresh view of the swarm
    found = await dht.get_many(keys, sufficient_expiration_time=float("inf")) if keys else {}
    out: list[dict[str, ServerInfo]] = []
    for key in keys:
        servers: dict[str, ServerInfo] = {}
        entry = found.get(key)
        if entry is not None and isinstance(entry.value, dict):
            for subkey, item in entry.value.items():
                try:
                    servers[str(subkey)] = ServerInfo.model_validate(item.value)
                except (ValidationError, AttributeError, TypeError) as e:
                    logger.debug("ignoring malformed record key=%s peer=%s error=%s", key, subkey, e)
        out.append(servers)
    return out

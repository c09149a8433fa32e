"""The swarm's model index: one well-known DHT key listing every model announced in the swarm.

A DHT cannot list its keys, so a monitor could otherwise only watch models it was told about. Every server adds
its model under one key as part of each announce (`announce_blocks(..., model=record)`):

    key    := MODEL_INDEX_KEY ("_corolla.models")
    subkey := the announcing server's peer id (records are owner-bound: dht.signed_records)
    value  := IndexEntry (prefix, num_blocks, model_type; a plain dict), expiring with the server's block records

`fetch_models` aggregates the entries by prefix. Any peer can write an entry under its own id (and make ids at
will), so entries are remote input and readers bound what they cost: at most MAX_INDEX_ENTRIES entries are looked
at, at most MAX_INDEXED_MODELS models kept: the ones the caller prefers (e.g. seen live before), then the ones
announced by the most servers, ties in an order drawn anew at each read (so fake models cannot keep a real one out
by sorting first). MAX_INDEXED_MODELS is as many entries as an honest DHT node keeps under one key
(record_storage.MAX_SUBKEYS_PER_KEY): fake models that outnumber a real one's servers cannot push it out of what
one honest node holds. Each model comes with a few of its announcers, so a reader can tell models whose servers
answer from fakes (monitor.collect pings one). A model's block count is what most of its servers say (ties: the
smaller count). So 64 or 10,000 fake entries cost one DHT read and a bounded amount of parsing; what a reader then
fetches per model is bounded by the caller.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections import Counter
from typing import Any, Collection, Mapping

from hivemind.dht.node import DHTNode
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from corolla.dht.lookup import lookup
from corolla.dht.record_storage import MAX_SUBKEYS_PER_KEY

logger = logging.getLogger(__name__)

MODEL_INDEX_KEY = "_corolla.models"
MAX_INDEXED_BLOCKS = 4096  # more blocks than any model has; a record claiming more is ignored
MAX_INDEXED_MODELS = MAX_SUBKEYS_PER_KEY  # models a reader keeps from the index (see the module docstring)
MAX_ANNOUNCERS = 8  # announcing servers a reader keeps per model
MAX_INDEX_ENTRIES = 16384  # entries (one per announcing server) a reader looks at (~ what one 4 MiB answer holds)
MAX_PREFIX_LENGTH = 200


class ModelRecord(BaseModel):
    """What the index says about one model: enough to read and judge its block records."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_blocks: int = Field(gt=0, le=MAX_INDEXED_BLOCKS)  # transformer blocks of the whole model
    model_type: str = Field(default="", max_length=64)  # HF model_type ("llama", ...), for display


class IndexedModel(ModelRecord):
    """A model as a reader of the index sees it: its record and some of the servers announcing it."""

    announcers: tuple[str, ...] = ()  # peer ids (at most MAX_ANNOUNCERS, in the read's drawn order)
    servers: int = 0  # entries announcing it


class IndexEntry(ModelRecord):
    """One server's entry in the index: its model's DHT prefix and record."""

    prefix: str = Field(min_length=1, max_length=MAX_PREFIX_LENGTH)  # the `prefix` of its block keys "{prefix}.{block}"


def aggregate_models(entries: Mapping[str, Any], *, prefer: Collection[str] = (), salt: bytes = b"",
                     max_entries: int = MAX_INDEX_ENTRIES, max_models: int = MAX_INDEXED_MODELS
                     ) -> dict[str, IndexedModel]:
    """The models of index entries (peer id -> entry as stored), in order: prefixes in `prefer` first, then the
    most announced, ties in the order of sha256(salt + prefix); each with the record most of its servers announce
    (ties: fewer blocks, then model_type) and up to MAX_ANNOUNCERS of them. Looks at `max_entries` entries (in the
    order of sha256(salt + peer id)) and keeps `max_models` models; malformed entries are skipped. Pure."""

    def drawn(name: str) -> bytes:
        return hashlib.sha256(salt + name.encode(errors="replace")).digest()

    claims: dict[str, Counter[ModelRecord]] = {}
    announcers: dict[str, list[str]] = {}
    for peer in sorted(entries, key=lambda p: drawn(str(p)))[:max_entries]:
        try:
            entry = IndexEntry.model_validate(entries[peer])
        except (ValidationError, TypeError) as e:
            logger.debug("ignoring malformed model index entry peer=%s error=%s", peer, e)
            continue
        claims.setdefault(entry.prefix, Counter())[ModelRecord(num_blocks=entry.num_blocks,
                                                               model_type=entry.model_type)] += 1
        if len(announcers.setdefault(entry.prefix, [])) < MAX_ANNOUNCERS:
            announcers[entry.prefix].append(str(peer))
    ranked = sorted(claims, key=lambda p: (p not in prefer, -sum(claims[p].values()), drawn(p)))[:max_models]
    models = {}
    for prefix in ranked:
        record = min(claims[prefix], key=lambda r: (-claims[prefix][r], r.num_blocks, r.model_type))
        models[prefix] = IndexedModel(num_blocks=record.num_blocks, model_type=record.model_type,
                                      announcers=tuple(announcers[prefix]), servers=sum(claims[prefix].values()))
    return models


async def fetch_models(dht: DHTNode, prefer: Collection[str] = ()) -> dict[str, IndexedModel]:
    """The models in the index, in order (see aggregate_models: `prefer`red prefixes first, ties drawn afresh at each
    call, bounded); {} when the index is empty."""
    entries = (await lookup(dht, [MODEL_INDEX_KEY]))[MODEL_INDEX_KEY]
    return aggregate_models({peer: value for peer, (value, _) in entries.items()}, prefer=prefer,
                            salt=secrets.token_bytes(16))

"""The swarm's model index: one well-known DHT key listing every model announced in the swarm.

A DHT cannot list its keys, so a monitor could otherwise only watch models it was told about. Every server adds
its model under one key as part of each announce (`announce_blocks(..., model=record)`):

    key    := MODEL_INDEX_KEY ("_corolla.models")
    subkey := the announcing server's peer id (records are owner-bound: dht.signed_records)
    value  := IndexEntry (prefix, num_blocks, model_type; a plain dict), expiring with the server's block records

`fetch_models` aggregates the entries by prefix. Any peer can write an entry under its own id (and make ids at
will), so entries are remote input and readers bound what they cost: at most MAX_INDEX_ENTRIES entries are looked
at, at most MAX_INDEXED_MODELS models kept: the ones the caller prefers (e.g. seen live before), then the ones with
the most *supported* announcers (entries held by more than one of the nodes asked, dht.lookup: a server's own entry
is stored on every node near the key, while a hostile node's fakes are answered by that node alone), then the most
announced, ties in an order drawn anew at each read (so fake models cannot keep a real one out by sorting first).

A model's block count is a *claim* of its entries, and entries of one prefix may disagree (255 fakes claiming a real
model's prefix with 4,096 blocks once outvoted its real servers). Each model keeps up to MAX_CLAIMS claims, each with
a few of its announcers (best supported first), ordered by supported announcers, then announcers, then fewer blocks;
the first is the model's record. A reader that can reach servers settles a contested model by pinging announcers of
each claim (monitor.collect: the claim whose announcers answer as servers of that prefix wins). So 64 or 10,000 fake
entries cost one DHT read and a bounded amount of parsing; what a reader then fetches per model is bounded by the
caller.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from typing import Any, Collection, Mapping

from hivemind.dht.node import DHTNode
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from corolla.dht.lookup import lookup_supported

logger = logging.getLogger(__name__)

MODEL_INDEX_KEY = "_corolla.models"
MAX_INDEXED_BLOCKS = 4096  # more blocks than any model has; a record claiming more is ignored
MAX_INDEXED_MODELS = 256  # models a reader keeps from the index (see the module docstring)
MAX_ANNOUNCERS = 8  # announcing servers a reader keeps per model claim
MAX_CLAIMS = 4  # block counts (and model types) a reader keeps per model
MAX_INDEX_ENTRIES = 16384  # entries (one per announcing server) a reader looks at (~ what one 4 MiB answer holds)
MAX_PREFIX_LENGTH = 200


class ModelRecord(BaseModel):
    """What the index says about one model: enough to read and judge its block records."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_blocks: int = Field(gt=0, le=MAX_INDEXED_BLOCKS)  # transformer blocks of the whole model
    model_type: str = Field(default="", max_length=64)  # HF model_type ("llama", ...), for display


class Claim(ModelRecord):
    """One record of a model that some of its entries announce, and who announces it."""

    announcers: tuple[str, ...] = ()  # peer ids (at most MAX_ANNOUNCERS), the best supported first
    servers: int = 0  # entries announcing it
    supported: int = 0  # of them, entries held by more than one source (dht.lookup)


class IndexedModel(ModelRecord):
    """A model as a reader of the index sees it: its record (its first claim's) and some of the servers announcing
    it, and every claim about it (see the module docstring)."""

    announcers: tuple[str, ...] = ()  # peer ids announcing the record (at most MAX_ANNOUNCERS)
    servers: int = 0  # entries announcing the model, all claims together
    claims: tuple[Claim, ...] = ()  # at most MAX_CLAIMS, the record's first


class IndexEntry(ModelRecord):
    """One server's entry in the index: its model's DHT prefix and record."""

    prefix: str = Field(min_length=1, max_length=MAX_PREFIX_LENGTH)  # the `prefix` of its block keys "{prefix}.{block}"


def aggregate_models(entries: Mapping[str, Any], *, support: Mapping[str, int] | None = None,
                     prefer: Collection[str] = (), salt: bytes = b"", max_entries: int = MAX_INDEX_ENTRIES,
                     max_models: int = MAX_INDEXED_MODELS) -> dict[str, IndexedModel]:
    """The models of index entries (peer id -> entry as stored; `support`: peer id -> sources holding its entry, 1 if
    absent), in order: prefixes in `prefer` first, then the most supported announcers, then the most announced, ties
    in the order of sha256(salt + prefix); each with its claims (see the module docstring; among claims equal in
    support and announcers, fewer blocks first, then model_type). Looks at `max_entries` entries (in the order of
    sha256(salt + peer id)) and keeps `max_models` models; malformed entries are skipped. Pure."""
    support = support or {}

    def drawn(name: str) -> bytes:
        return hashlib.sha256(salt + name.encode(errors="replace")).digest()

    claims: dict[str, dict[ModelRecord, list[str]]] = {}
    for peer in sorted(entries, key=lambda p: drawn(str(p)))[:max_entries]:
        try:
            entry = IndexEntry.model_validate(entries[peer])
        except (ValidationError, TypeError) as e:
            logger.debug("ignoring malformed model index entry peer=%s error=%s", peer, e)
            continue
        record = ModelRecord(num_blocks=entry.num_blocks, model_type=entry.model_type)
        claims.setdefault(entry.prefix, {}).setdefault(record, []).append(str(peer))

    def supported(peers: list[str]) -> int:
        return sum(support.get(peer, 1) > 1 for peer in peers)

    def total(prefix: str) -> tuple[int, int]:
        by_claim = claims[prefix].values()
        return sum(supported(peers) for peers in by_claim), sum(len(peers) for peers in by_claim)

    ranked = sorted(claims, key=lambda p: (p not in prefer, *(-n for n in total(p)), drawn(p)))[:max_models]
    models = {}
    for prefix in ranked:
        order = sorted(claims[prefix].items(), key=lambda item: (-supported(item[1]), -len(item[1]),
                                                                  item[0].num_blocks, item[0].model_type))
        kept = tuple(
            Claim(num_blocks=record.num_blocks, model_type=record.model_type, servers=len(peers),
                  supported=supported(peers),
                  announcers=tuple(sorted(peers, key=lambda p: -support.get(p, 1))[:MAX_ANNOUNCERS]))
            for record, peers in order[:MAX_CLAIMS]
        )
        first = kept[0]
        models[prefix] = IndexedModel(num_blocks=first.num_blocks, model_type=first.model_type,
                                      announcers=first.announcers, servers=total(prefix)[1], claims=kept)
    return models


async def fetch_models(dht: DHTNode, prefer: Collection[str] = ()) -> dict[str, IndexedModel]:
    """The models in the index, in order (see aggregate_models: `prefer`red prefixes first, ties drawn afresh at each
    call, bounded); {} when the index is empty."""
    entries = (await lookup_supported(dht, [MODEL_INDEX_KEY]))[MODEL_INDEX_KEY]
    return aggregate_models({peer: found.value for peer, found in entries.items()},
                            support={peer: found.support for peer, found in entries.items()}, prefer=prefer,
                            salt=secrets.token_bytes(16))

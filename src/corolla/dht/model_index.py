"""The swarm's model index: one well-known DHT key listing every model announced in the swarm.

A DHT cannot list its keys, so a monitor could otherwise only watch models it was told about. Every server adds
its model under one key as part of each announce (`announce_blocks(..., model=record)`):

    key    := MODEL_INDEX_KEY ("_corolla.models")
    subkey := the model's DHT prefix (the `prefix` of its block keys "{prefix}.{block}")
    value  := ModelRecord (as a plain dict), expiring with the server's block records

All servers of one model write the same subkey with the same record, so it lives as long as any of them keeps
announcing. Records are remote input: they are validated, and bounded so that a bad one cannot make a reader
fetch millions of keys.
"""

from __future__ import annotations

import logging

from hivemind.dht.node import DHTNode
from pydantic import BaseModel, ConfigDict, Field, ValidationError

logger = logging.getLogger(__name__)

MODEL_INDEX_KEY = "_corolla.models"
MAX_INDEXED_BLOCKS = 4096  # more blocks than any model has; a record claiming more is ignored
MAX_INDEXED_MODELS = 256  # models read from the index at most (the first ones by prefix)
MAX_PREFIX_LENGTH = 200


class ModelRecord(BaseModel):
    """What the index says about one model: enough to read and judge its block records."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_blocks: int = Field(gt=0, le=MAX_INDEXED_BLOCKS)  # transformer blocks of the whole model
    model_type: str = Field(default="", max_length=64)  # HF model_type ("llama", ...), for display


async def fetch_models(dht: DHTNode) -> dict[str, ModelRecord]:
    """Every model in the index, by DHT prefix (sorted), dropping malformed records; {} when the index is empty."""
    # an infinite sufficient expiration asks the peers, not our local cache: a fresh view of the swarm
    entry = await dht.get(MODEL_INDEX_KEY, sufficient_expiration_time=float("inf"))
    if entry is None or not isinstance(entry.value, dict):
        return {}
    models: dict[str, ModelRecord] = {}
    for subkey in sorted(entry.value, key=str)[:MAX_INDEXED_MODELS]:
        prefix = str(subkey)
        if not prefix or len(prefix) > MAX_PREFIX_LENGTH:
            continue
        try:
            models[prefix] = ModelRecord.model_validate(entry.value[subkey].value)
        except (ValidationError, AttributeError, TypeError) as e:
            logger.debug("ignoring malformed model record prefix=%s error=%s", prefix, e)
    return models

"""A thin layer over hivemind's DHT: start a node, announce a server's blocks, read who serves what."""

from corolla.dht.identity import load_or_create_identity
from corolla.dht.model_index import MODEL_INDEX_KEY, IndexedModel, ModelRecord, fetch_models
from corolla.dht.node import SwarmNode, create_swarm_node
from corolla.dht.records import announce_blocks, block_key, fetch_block_servers, model_dht_prefix

__all__ = [
    "SwarmNode", "create_swarm_node", "announce_blocks", "block_key", "fetch_block_servers", "model_dht_prefix",
    "MODEL_INDEX_KEY", "IndexedModel", "ModelRecord", "fetch_models", "load_or_create_identity",
]

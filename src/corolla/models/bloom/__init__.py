"""The BLOOM family: our own ALiBi block, client head and checkpoint naming."""

from corolla.models.bloom.block import (
    BloomBlock,
    alibi_slopes,
    block_prefix,
    bloom_gelu,
    kv_layout,
    num_blocks,
)
from corolla.models.bloom.head import BloomClientHead, canonical_name, is_head_tensor

__all__ = [
    "BloomBlock",
    "BloomClientHead",
    "alibi_slopes",
    "block_prefix",
    "bloom_gelu",
    "canonical_name",
    "is_head_tensor",
    "kv_layout",
    "num_blocks",
]

"""The Falcon family (rotary Falcon: 7B, 40B, 180B, Falcon2-11B): our own block, client head and checkpoint naming."""

from corolla.models.falcon.block import FalconBlock, block_prefix, check_supported, kv_layout, norm_layout, num_blocks
from corolla.models.falcon.head import FalconClientHead, is_head_tensor

__all__ = [
    "FalconBlock",
    "FalconClientHead",
    "block_prefix",
    "check_supported",
    "is_head_tensor",
    "kv_layout",
    "norm_layout",
    "num_blocks",
]

"""The Mixtral family: our own sparse-MoE block; client head and checkpoint naming are the Llama family's."""

from corolla.models.llama.block import block_prefix, kv_layout, num_blocks
from corolla.models.llama.head import is_head_tensor
from corolla.models.mixtral.block import MixtralBlock

__all__ = ["MixtralBlock", "block_prefix", "is_head_tensor", "kv_layout", "num_blocks"]

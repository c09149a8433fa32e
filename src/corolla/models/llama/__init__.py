"""The Llama family (Llama, Mistral, Qwen2, Qwen3): our own block, client head and checkpoint naming."""

from corolla.models.llama.block import LlamaBlock, block_prefix, kv_layout, num_blocks, sliding_window_of
from corolla.models.llama.head import LlamaClientHead, is_head_tensor
from corolla.models.llama.rotary import SUPPORTED_ROPE_TYPES, RotaryEmbedding, compute_inv_freq, head_dim_of

__all__ = [
    "SUPPORTED_ROPE_TYPES",
    "LlamaBlock",
    "LlamaClientHead",
    "RotaryEmbedding",
    "block_prefix",
    "compute_inv_freq",
    "head_dim_of",
    "is_head_tensor",
    "kv_layout",
    "num_blocks",
    "sliding_window_of",
]
